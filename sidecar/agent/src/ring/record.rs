//! One finished operation as the ring carries it: everything a span, a
//! metric and the RAS view need, by value (a record never refers to state
//! that could have changed by the time it is read), in 7 words after the
//! ring entry's sequence word: one cache line per entry.
//!
//! ```text
//! word 1..=2  communicator key (16 bytes, `CommKey`)
//! word 3      rank (24 bits) | nranks (24) | op (8) | dtype (8)
//! word 4      algo (8) | flags (8: group, duration in us) | outcome (8) | 0 (8) | duration (32)
//! word 5      bytes
//! word 6      sequence number (48 bits) | slot (16)
//! word 7      start, ns since the Unix epoch
//! ```
//!
//! The duration is in nanoseconds up to 4.29 s, in microseconds beyond
//! (flag), saturating after 71 minutes.

use super::codes;

/// Words of a record (after the sequence word).
pub const WORDS: usize = 7;
/// Words of a communicator key.
pub const KEY_WORDS: usize = 2;
const KEY_BYTES: usize = KEY_WORDS * 8;
/// `flags` bits.
const FLAG_GROUP: u64 = 1;
const FLAG_MICROS: u64 = 2;
const U24: u64 = (1 << 24) - 1;
const U48: u64 = (1 << 48) - 1;
/// `slot` value of a communicator without a slot in the table.
pub const NO_SLOT: u16 = u16::MAX;

/// A communicator's label as 16 bytes: a label up to 16 bytes is kept as
/// it is (zero padded; libcomm's default labels are 8 hex digits); a longer
/// one keeps its first 7 bytes, a `~` and 8 hex digits of a hash of the
/// whole label. The rank computes it for records and slots; the sidecar
/// computes it from the label a `Register` names, to show the full label.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CommKey(pub [u8; KEY_BYTES]);

impl CommKey {
    pub fn of(label: &str) -> CommKey {
        let b = label.as_bytes();
        let mut k = [0u8; KEY_BYTES];
        if b.len() <= KEY_BYTES {
            k[..b.len()].copy_from_slice(b);
        } else {
            // Cut at a character boundary so the key stays text.
            let mut n = 7;
            while !label.is_char_boundary(n) {
                n -= 1;
            }
            k[..n].copy_from_slice(&b[..n]);
            k[n] = b'~';
            let h = fnv1a(b);
            let h = format!("{:08x}", (h ^ (h >> 32)) as u32);
            k[n + 1..n + 9].copy_from_slice(h.as_bytes());
        }
        CommKey(k)
    }

    /// The key as text (the label itself when it fit).
    pub fn text(&self) -> String {
        let n = self.0.iter().position(|c| *c == 0).unwrap_or(KEY_BYTES);
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
        let mut k = [0u8; KEY_BYTES];
        for (i, x) in w.iter().take(KEY_WORDS).enumerate() {
            k[i * 8..i * 8 + 8].copy_from_slice(&x.to_le_bytes());
        }
        CommKey(k)
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
    /// Rank and size (24 bits each on the ring).
    pub rank: u32,
    pub nranks: u32,
    pub op: u8,
    pub dtype: u8,
    pub algo: u8,
    pub group: bool,
    /// [`codes::OK`] or [`codes::ERROR`] (8 bits on the ring).
    pub outcome: u16,
    /// The communicator's slot in the table, or [`NO_SLOT`].
    pub slot: u16,
    pub bytes: u64,
    /// Per communicator and rank (48 bits on the ring).
    pub seq: u64,
    pub start_ns: u64,
    pub end_ns: u64,
}

/// A duration as the ring keeps it: (in microseconds?, value).
fn encode_duration(ns: u64) -> (bool, u32) {
    match u32::try_from(ns) {
        Ok(v) => (false, v),
        Err(_) => (true, u32::try_from(ns / 1000).unwrap_or(u32::MAX)),
    }
}

impl Record {
    pub fn encode(&self) -> [u64; WORDS] {
        let (micros, d) = encode_duration(self.duration_ns());
        let flags = if self.group { FLAG_GROUP } else { 0 } | if micros { FLAG_MICROS } else { 0 };
        let [k0, k1] = self.comm.words();
        [
            k0,
            k1,
            (self.rank as u64).min(U24)
                | (self.nranks as u64).min(U24) << 24
                | (self.op as u64) << 48
                | (self.dtype as u64) << 56,
            self.algo as u64 | flags << 8 | (self.outcome.min(255) as u64) << 16 | (d as u64) << 32,
            self.bytes,
            (self.seq & U48) | (self.slot as u64) << 48,
            self.start_ns,
        ]
    }

    /// Decodes words read from shared memory. Any bit pattern decodes (the
    /// names of out-of-range codes are "other"); nothing is trusted.
    pub fn decode(w: &[u64; WORDS]) -> Record {
        let flags = (w[3] >> 8) & 0xff;
        let d = w[3] >> 32;
        let d = if flags & FLAG_MICROS != 0 {
            d * 1000
        } else {
            d
        };
        Record {
            comm: CommKey::from_words(&w[..KEY_WORDS]),
            rank: (w[2] & U24) as u32,
            nranks: ((w[2] >> 24) & U24) as u32,
            op: (w[2] >> 48) as u8,
            dtype: (w[2] >> 56) as u8,
            algo: w[3] as u8,
            group: flags & FLAG_GROUP != 0,
            outcome: ((w[3] >> 16) & 0xff) as u16,
            slot: (w[5] >> 48) as u16,
            bytes: w[4],
            seq: w[5] & U48,
            start_ns: w[6],
            end_ns: w[6].saturating_add(d),
        }
    }

    pub fn op_name(&self) -> &'static str {
        codes::op_name(self.op)
    }

    pub fn ok(&self) -> bool {
        self.outcome == codes::OK
    }

    /// End minus start (0 for a clock that went back).
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
            seq: (1 << 48) - 2,
            start_ns: 1_700_000_000_000_000_000,
            end_ns: 1_700_000_000_000_004_000,
        };
        assert_eq!(Record::decode(&r.encode()), r);
        assert_eq!(r.duration_ns(), 4000);
        assert_eq!(r.op_name(), "all_gather");
        // Beyond 4.29 s the duration is kept in microseconds.
        let long = Record {
            end_ns: r.start_ns + 700_000_123_456,
            ..r
        };
        assert_eq!(
            Record::decode(&long.encode()).duration_ns(),
            700_000_123_000
        );
        // Out-of-range fields saturate rather than wrap.
        let big = Record {
            rank: u32::MAX,
            ..r
        };
        assert_eq!(Record::decode(&big.encode()).rank, (1 << 24) - 1);
    }

    #[test]
    fn keys_keep_short_labels_and_tell_long_ones_apart() {
        assert_eq!(CommKey::of("world").text(), "world");
        assert_eq!(CommKey::of("0123456789abcdef").text(), "0123456789abcdef");
        let long_a = format!("{}a", "x".repeat(30));
        let long_b = format!("{}b", "x".repeat(30));
        let (a, b) = (CommKey::of(&long_a), CommKey::of(&long_b));
        assert_ne!(a, b);
        assert_eq!(a, CommKey::of(&long_a));
        assert!(a.text().starts_with("xxxxxxx~") && a.text().len() == 16);
        // Multi-byte characters are never cut in half.
        let accents = "é".repeat(20);
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
        assert_eq!(r.duration_ns(), 0, "the end saturates");
    }
}
