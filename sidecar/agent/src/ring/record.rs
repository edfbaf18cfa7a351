//! One finished operation as the ring carries it: everything a span, a
//! metric and the RAS view need, by value (a record never refers to state
//! that could have changed by the time it is read), in 15 words after the
//! ring entry's sequence word.
//!
//! ```text
//! word 1..=8  communicator key (64 bytes, `CommKey`)
//! word 9      rank | nranks << 32
//! word 10     op | dtype << 8 | algo << 16 | flags << 24 | outcome << 32 | slot << 48
//! word 11     bytes
//! word 12     sequence number (per communicator and rank)
//! word 13     start, ns since the Unix epoch
//! word 14     end, ns since the Unix epoch
//! word 15     reserved (0)
//! ```

use super::codes;
use std::sync::atomic::{AtomicU64, Ordering};

/// Words of a record (after the sequence word).
pub const WORDS: usize = 15;
const KEY_WORDS: usize = 8;
/// `flags` bit: the operation was a group.
const FLAG_GROUP: u8 = 1;
/// `slot` value of a communicator without a slot in the table.
pub const NO_SLOT: u16 = u16::MAX;

/// A communicator's label as 64 bytes: labels up to 64 bytes are kept as
/// they are (zero padded); a longer one keeps its first 47 bytes, a `~` and
/// 16 hex digits of a hash of the whole label. The rank computes it for
/// records and slots; the sidecar computes it from the label a `Register`
/// names to find the full label again.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CommKey(pub [u8; 64]);

impl CommKey {
    pub fn of(label: &str) -> CommKey {
        let b = label.as_bytes();
        let mut k = [0u8; 64];
        if b.len() <= 64 {
            k[..b.len()].copy_from_slice(b);
        } else {
            // Cut at a character boundary so the key stays text.
            let mut n = 47;
            while !label.is_char_boundary(n) {
                n -= 1;
            }
            k[..n].copy_from_slice(&b[..n]);
            k[n] = b'~';
            let h = format!("{:016x}", fnv1a(b));
            k[n + 1..n + 17].copy_from_slice(h.as_bytes());
        }
        CommKey(k)
    }

    /// The key as text (the label itself when it fit).
    pub fn text(&self) -> String {
        let n = self.0.iter().position(|c| *c == 0).unwrap_or(64);
        String::from_utf8_lossy(&self.0[..n]).into_owned()
    }

    pub fn words(&self) -> [u64; KEY_WORDS] {
        let mut w = [0u64; KEY_WORDS];
        for (i, c) in self.0.chunks_exact(8).enumerate() {
            w[i] = u64::from_le_bytes(c.try_into().unwrap_or_default());
        }
        w
    }

    pub fn from_words(w: &[u64]) -> CommKey {
        let mut k = [0u8; 64];
        for (i, x) in w.iter().take(KEY_WORDS).enumerate() {
            k[i * 8..i * 8 + 8].copy_from_slice(&x.to_le_bytes());
        }
        CommKey(k)
    }

    /// Whether `words` (read from shared memory) hold this key.
    pub fn matches(&self, words: &[AtomicU64]) -> bool {
        words.len() >= KEY_WORDS
            && self
                .words()
                .iter()
                .zip(words)
                .all(|(a, b)| *a == b.load(Ordering::Relaxed))
    }
}

impl std::fmt::Debug for CommKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CommKey({:?})", self.text())
    }
}

fn fnv1a(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf29ce484222325u64, |h, c| {
        (h ^ *c as u64).wrapping_mul(0x100000001b3)
    })
}

/// One finished operation, by value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    pub comm: CommKey,
    pub rank: u32,
    pub nranks: u32,
    pub op: u8,
    pub dtype: u8,
    pub algo: u8,
    pub group: bool,
    /// [`codes::OK`] or [`codes::ERROR`].
    pub outcome: u16,
    /// The communicator's slot in the table, or [`NO_SLOT`].
    pub slot: u16,
    pub bytes: u64,
    pub seq: u64,
    pub start_ns: u64,
    pub end_ns: u64,
}

impl Record {
    pub fn encode(&self) -> [u64; WORDS] {
        let mut w = [0u64; WORDS];
        w[..KEY_WORDS].copy_from_slice(&self.comm.words());
        w[8] = self.rank as u64 | (self.nranks as u64) << 32;
        let flags = if self.group { FLAG_GROUP } else { 0 };
        w[9] = self.op as u64
            | (self.dtype as u64) << 8
            | (self.algo as u64) << 16
            | (flags as u64) << 24
            | (self.outcome as u64) << 32
            | (self.slot as u64) << 48;
        w[10] = self.bytes;
        w[11] = self.seq;
        w[12] = self.start_ns;
        w[13] = self.end_ns;
        w
    }

    /// Decodes words read from shared memory. Any bit pattern decodes (the
    /// names of out-of-range codes are "other"); nothing is trusted.
    pub fn decode(w: &[u64; WORDS]) -> Record {
        Record {
            comm: CommKey::from_words(&w[..KEY_WORDS]),
            rank: w[8] as u32,
            nranks: (w[8] >> 32) as u32,
            op: w[9] as u8,
            dtype: (w[9] >> 8) as u8,
            algo: (w[9] >> 16) as u8,
            group: (w[9] >> 24) as u8 & FLAG_GROUP != 0,
            outcome: (w[9] >> 32) as u16,
            slot: (w[9] >> 48) as u16,
            bytes: w[10],
            seq: w[11],
            start_ns: w[12],
            end_ns: w[13],
        }
    }

    pub fn op_name(&self) -> &'static str {
        codes::op_name(self.op)
    }

    pub fn ok(&self) -> bool {
        self.outcome == codes::OK
    }

    /// End minus start (0 for a clock that went back or garbage).
    pub fn duration_ns(&self) -> u64 {
        self.end_ns.saturating_sub(self.start_ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        let r = Record {
            comm: CommKey::of("9f3a11c0"),
            rank: 3,
            nranks: 8,
            op: codes::op_code("all_gather"),
            dtype: codes::dtype_code("bfloat16"),
            algo: codes::algo_code("ll2"),
            group: true,
            outcome: codes::ERROR,
            slot: 17,
            bytes: 1 << 40,
            seq: u64::MAX - 1,
            start_ns: 1_700_000_000_000_000_000,
            end_ns: 1_700_000_000_000_004_000,
        };
        assert_eq!(Record::decode(&r.encode()), r);
        assert_eq!(r.duration_ns(), 4000);
        assert_eq!(r.op_name(), "all_gather");
    }

    #[test]
    fn keys_keep_short_labels_and_tell_long_ones_apart() {
        assert_eq!(CommKey::of("world").text(), "world");
        let long_a = format!("{}a", "x".repeat(70));
        let long_b = format!("{}b", "x".repeat(70));
        let (a, b) = (CommKey::of(&long_a), CommKey::of(&long_b));
        assert_ne!(a, b);
        assert_eq!(a, CommKey::of(&long_a));
        assert!(a.text().starts_with(&"x".repeat(47)) && a.text().contains('~'));
        // Multi-byte characters are never cut in half.
        let accents = "é".repeat(40);
        assert!(CommKey::of(&accents).text().is_char_boundary(0));
        assert!(!CommKey::of(&accents).text().contains('\u{fffd}'));
        let k = CommKey::of("c");
        assert_eq!(CommKey::from_words(&k.words()), k);
    }

    /// Any words decode without panicking.
    #[test]
    fn garbage_decodes() {
        let r = Record::decode(&[u64::MAX; WORDS]);
        assert_eq!(r.op_name(), "other");
        assert!(!r.ok());
        assert_eq!(r.duration_ns(), 0);
    }
}
