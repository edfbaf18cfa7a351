//! Where everything lives in a telemetry segment, in 64-bit words, and the
//! bounds a segment from another process must respect before it is mapped.

/// "WEFTRNG1", little endian.
pub const MAGIC: u64 = u64::from_le_bytes(*b"WEFTRNG1");
/// Bumped on any change of the layout below (a reader refuses another).
pub const VERSION: u64 = 4;

/// The header: one page.
pub const HEADER_WORDS: usize = 512;
/// Words of one ring entry: the sequence word, then the record (64 bytes:
/// one cache line).
pub const RECORD_WORDS: usize = 8;
/// Words of one communicator slot (see `slots`).
pub const SLOT_WORDS: usize = 128;

/// Ring capacities (records) a segment may have: powers of two in this range.
pub const MIN_RECORDS: u64 = 64;
pub const MAX_RECORDS: u64 = 1 << 18;
/// Records per process by default (2 MiB): at 300,000 collectives a
/// second and a drain every 5 ms, 20 drains of slack.
pub const DEFAULT_RECORDS: u64 = 1 << 15;
/// Communicator slots per segment, at most (and by default).
pub const MAX_SLOTS: u64 = 4096;
pub const DEFAULT_SLOTS: u64 = 1024;

// Header words. The three counters each own a cache line (8 words).
pub const H_MAGIC: usize = 0;
pub const H_VERSION: usize = 1;
pub const H_CAPACITY: usize = 2;
pub const H_SLOTS: usize = 3;
/// `RECORD_WORDS | SLOT_WORDS << 32`: a reader checks both.
pub const H_SHAPE: usize = 4;
/// Random per segment: tells a reconnecting process's segment from another.
pub const H_SEGMENT_ID: usize = 5;
/// The creating process's pid, as it sees itself (informational).
pub const H_PID: usize = 6;
/// Bit [`FLAG_CLOSING`]: the process closed its agent (a normal exit).
pub const H_FLAGS: usize = 7;
/// The producers' ticket: records ever claimed.
pub const H_TAIL: usize = 16;
/// Records dropped because the ring was full.
pub const H_DROPPED: usize = 24;
/// The consumer's position (records consumed), for a reader that maps the
/// segment again (a reconnect) to go on where the last one stopped.
pub const H_HEAD: usize = 32;
/// Slots ever opened (the highest index + 1): a reader scans no further.
pub const H_SLOTS_USED: usize = 40;

pub const FLAG_CLOSING: u64 = 1;

/// The shape of one segment: ring capacity and slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub records: u64,
    pub slots: u64,
}

impl Geometry {
    /// The default shape with `records` (rounded up to a power of two and
    /// clamped to the allowed range).
    pub fn with_records(records: u64) -> Geometry {
        Geometry {
            records: records
                .clamp(MIN_RECORDS, MAX_RECORDS)
                .next_power_of_two()
                .min(MAX_RECORDS),
            slots: DEFAULT_SLOTS,
        }
    }

    /// Whether a reader accepts this shape (checked before any address is
    /// computed from it).
    pub fn valid(&self) -> bool {
        self.records.is_power_of_two()
            && (MIN_RECORDS..=MAX_RECORDS).contains(&self.records)
            && (1..=MAX_SLOTS).contains(&self.slots)
    }

    /// The first word of slot `i`.
    pub fn slot_word(&self, i: usize) -> usize {
        HEADER_WORDS + i * SLOT_WORDS
    }

    /// The first word (the sequence word) of ring entry `i`.
    pub fn record_word(&self, i: usize) -> usize {
        HEADER_WORDS + self.slots as usize * SLOT_WORDS + i * RECORD_WORDS
    }

    /// Words in the whole segment.
    pub fn words(&self) -> usize {
        self.record_word(self.records as usize)
    }

    pub fn bytes(&self) -> usize {
        self.words() * 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_is_bounded_and_sized() {
        let g = Geometry::with_records(1000);
        assert_eq!(g.records, 1024);
        assert!(g.valid());
        assert_eq!(
            g.bytes(),
            4096 + DEFAULT_SLOTS as usize * SLOT_WORDS * 8 + 1024 * 64
        );
        assert_eq!(Geometry::with_records(1).records, MIN_RECORDS);
        assert_eq!(Geometry::with_records(u64::MAX).records, MAX_RECORDS);
        assert!(
            !Geometry {
                records: 1000,
                slots: 4
            }
            .valid()
        );
        assert!(
            !Geometry {
                records: 1024,
                slots: 0
            }
            .valid()
        );
        // The counters do not share a cache line with each other or the rest.
        const { assert!(H_TAIL >= 8 && H_DROPPED - H_TAIL >= 8 && H_HEAD - H_DROPPED >= 8) };
        const { assert!(H_HEAD + 8 <= H_SLOTS_USED && H_SLOTS_USED + 8 <= HEADER_WORDS) };
    }
}
