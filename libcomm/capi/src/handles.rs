//! The communicator registry: `ncclComm_t` values are checked handles, never
//! pointers.
//!
//! A handle packs a tag, a slot index and the slot's generation into one
//! pointer-sized value (`0x57ef` in the top 16 bits, which makes it a
//! non-canonical address on x86-64/aarch64, so even a program that
//! dereferences it faults instead of reading memory). Looking a handle up
//! checks the tag, the index and the generation; a destroyed or aborted
//! communicator leaves a record in its slot so the error can say which
//! communicator it was, when it ended and how ("... was destroyed at ...;
//! this is a second destroy"). A slot is reused (with the next generation)
//! only when many slots are free, so recent records stay informative; an
//! older stale handle is still refused, as "stale".

use crate::errors::{CResult, Fail};
use crate::redop::RedOps;
use libcomm::{Communicator, Config};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

const TAG: u64 = 0x57ef;
const INDEX_BITS: u32 = 24;
const GEN_BITS: u32 = 24;
const GEN_MASK: u64 = (1 << GEN_BITS) - 1;
const INDEX_MASK: u64 = (1 << INDEX_BITS) - 1;
/// Free slots kept before the oldest is reused.
const REUSE_AFTER_FREE: usize = 1024;

/// One live communicator as the C ABI sees it.
pub struct CommEntry {
    /// "communicator N" in messages: the order of creation in this process, from 1.
    pub serial: u64,
    pub comm: Communicator,
    /// NCCL `blocking` of its configuration (init/split return ncclInProgress when false).
    pub blocking: bool,
    /// The configuration children inherit when split with a NULL config.
    pub cfg: Config,
    pub finalized: AtomicBool,
    pub redops: RedOps,
    pub registrations: Mutex<Vec<u64>>,
}

impl CommEntry {
    /// "communicator 3 (id 1a2b3c4d, rank 1 of 4, job local-77)".
    pub fn describe(&self) -> String {
        format!(
            "communicator {} (id {}, rank {} of {}, job {})",
            self.serial,
            self.comm.id(),
            self.comm.rank(),
            self.comm.count(),
            job()
        )
    }
}

pub fn job() -> String {
    weft_contract::params::WEFT_JOB
        .raw()
        .unwrap_or_else(|| format!("pid-{}", std::process::id()))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    Destroyed,
    Aborted,
}

/// What remains of a communicator after destroy/abort.
#[derive(Clone)]
struct Tombstone {
    what: String,
    how: Ended,
    at: SystemTime,
}

enum Slot {
    Live(Arc<CommEntry>),
    Dead(Tombstone),
}

struct SlotCell {
    generation: u64,
    slot: Slot,
}

struct Registry {
    slots: Vec<SlotCell>,
    free: VecDeque<usize>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    slots: Vec::new(),
    free: VecDeque::new(),
});
static SERIAL: AtomicU64 = AtomicU64::new(1);

fn reg() -> MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

fn pack(index: usize, generation: u64) -> usize {
    ((TAG << 48) | ((index as u64 & INDEX_MASK) << GEN_BITS) | (generation & GEN_MASK)) as usize
}

fn unpack(h: usize) -> Option<(usize, u64)> {
    let v = h as u64;
    if v >> 48 != TAG {
        return None;
    }
    Some((((v >> GEN_BITS) & INDEX_MASK) as usize, v & GEN_MASK))
}

/// Next serial number ("communicator N").
pub fn next_serial() -> u64 {
    SERIAL.fetch_add(1, Ordering::Relaxed)
}

/// Registers a communicator; returns its handle.
pub fn insert(entry: CommEntry) -> CResult<usize> {
    let mut r = reg();
    let entry = Arc::new(entry);
    if r.free.len() > REUSE_AFTER_FREE {
        let i = r.free.pop_front().expect("non-empty");
        let cell = &mut r.slots[i];
        cell.generation = (cell.generation + 1) & GEN_MASK;
        cell.slot = Slot::Live(entry);
        return Ok(pack(i, cell.generation));
    }
    let i = r.slots.len();
    if i as u64 > INDEX_MASK {
        return Err(Fail::new(
            crate::errors::SYSTEM_ERROR,
            "too many communicators alive in this process (16M)",
        ));
    }
    r.slots.push(SlotCell {
        generation: 1,
        slot: Slot::Live(entry),
    });
    Ok(pack(i, 1))
}

fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86400), secs.rem_euclid(86400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        d.subsec_millis()
    )
}

/// Looks up a handle for `what` (e.g. "ncclAllReduce"); refuses NULL, forged,
/// stale, destroyed and aborted handles with `ncclInvalidArgument`.
pub fn get(h: usize, what: &str) -> CResult<Arc<CommEntry>> {
    let r = reg();
    match locate(&r, h, what)? {
        Slot::Live(e) => Ok(e.clone()),
        Slot::Dead(t) => Err(dead_error(t, what)),
    }
}

fn dead_error(t: &Tombstone, what: &str) -> Fail {
    let how = match t.how {
        Ended::Destroyed => "destroyed",
        Ended::Aborted => "aborted (and freed)",
    };
    let tail = match what {
        "ncclCommDestroy" => "this is a second destroy".to_string(),
        "ncclCommAbort" => format!("this is an abort after the communicator was {how}"),
        _ => format!(
            "{what} on it is a use after {}",
            match t.how {
                Ended::Destroyed => "destroy",
                Ended::Aborted => "abort",
            }
        ),
    };
    Fail::arg(format!("{} was {how} at {}; {tail}", t.what, rfc3339(t.at)))
}

fn locate<'r>(r: &'r Registry, h: usize, what: &str) -> CResult<&'r Slot> {
    if h == 0 {
        return Err(Fail::arg(format!(
            "the communicator is NULL (pass a communicator created by ncclCommInitRank/ncclCommSplit to {what})"
        )));
    }
    let Some((i, generation)) = unpack(h) else {
        return Err(Fail::arg(format!(
            "{h:#x} is not a communicator handle (forged, uninitialised or corrupted value)"
        )));
    };
    let Some(cell) = r.slots.get(i) else {
        return Err(Fail::arg(format!(
            "{h:#x} is not a communicator handle (slot {i} was never allocated: forged value)"
        )));
    };
    if cell.generation != generation {
        return Err(Fail::arg(format!(
            "communicator handle {h:#x} is stale: it named generation {generation} of slot {i}, which was destroyed long ago and reused (now generation {})",
            cell.generation
        )));
    }
    Ok(&cell.slot)
}

/// Removes a live communicator from the registry, leaving a tombstone; the
/// caller then destroys/aborts it. A dead or bad handle is an error naming it.
pub fn remove(h: usize, how: Ended, what: &str) -> CResult<Arc<CommEntry>> {
    let mut r = reg();
    let e = match locate(&r, h, what)? {
        Slot::Live(e) => e.clone(),
        Slot::Dead(t) => return Err(dead_error(t, what)),
    };
    let (i, _) = unpack(h).expect("located");
    r.slots[i].slot = Slot::Dead(Tombstone {
        what: e.describe(),
        how,
        at: SystemTime::now(),
    });
    r.free.push_back(i);
    Ok(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_roundtrip_and_tag() {
        let h = pack(5, 7);
        assert_eq!(unpack(h), Some((5, 7)));
        assert_eq!(unpack(0x1000), None);
        let err = |h| get(h, "x").err().expect("refused").msg;
        assert!(err(0).contains("NULL"));
        assert!(err(0xdead_beef).contains("not a communicator"));
        assert!(err(pack(1 << 20, 1)).contains("never allocated"));
    }

    fn entry() -> CommEntry {
        let comm = Communicator::init_all(1).unwrap().pop().unwrap();
        CommEntry {
            serial: next_serial(),
            cfg: comm.config().clone(),
            comm,
            blocking: true,
            finalized: AtomicBool::new(false),
            redops: RedOps::default(),
            registrations: Mutex::new(Vec::new()),
        }
    }

    #[test]
    fn destroyed_and_stale_handles_are_refused_with_history() {
        let h = insert(entry()).unwrap();
        let e = get(h, "ncclCommCount").unwrap();
        let serial = e.serial;
        let removed = remove(h, Ended::Destroyed, "ncclCommDestroy").unwrap();
        assert!(Arc::ptr_eq(&e, &removed));
        let again = remove(h, Ended::Destroyed, "ncclCommDestroy")
            .err()
            .unwrap();
        assert_eq!(again.code, crate::errors::INVALID_ARGUMENT);
        assert!(
            again.msg.contains(&format!("communicator {serial} "))
                && again.msg.contains("was destroyed at 20")
                && again.msg.contains("this is a second destroy"),
            "{}",
            again.msg
        );
        let used = get(h, "ncclAllReduce").err().unwrap();
        assert!(
            used.msg
                .contains("ncclAllReduce on it is a use after destroy"),
            "{}",
            used.msg
        );
        // The same slot with another generation: a stale (or forged) handle.
        let (i, g) = unpack(h).unwrap();
        let stale = get(pack(i, g + 1), "x").err().unwrap();
        assert!(stale.msg.contains("stale"), "{}", stale.msg);

        let h2 = insert(entry()).unwrap();
        assert_ne!(h, h2, "a freed slot is not reused while few are free");
        remove(h2, Ended::Aborted, "ncclCommAbort").unwrap();
        let m = get(h2, "ncclSend").err().unwrap().msg;
        assert!(
            m.contains("aborted") && m.contains("use after abort"),
            "{m}"
        );
    }

    #[test]
    fn dates() {
        let t = SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(1_700_000_000_123);
        assert_eq!(rfc3339(t), "2023-11-14T22:13:20.123Z");
    }
}
