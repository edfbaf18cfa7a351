//! The communicator as the cross-host executor's partner (`crosshost/`,
//! host memory; here, not there, so `crosshost/` stays below the
//! communicator and the communicator can run collectives on it): the all-gather its handle exchange and layout use
//! ([`Exchange`]) and the host-local mover ([`CommMover`]): a host-local
//! communicator's grouped sends and receives, its errors renamed to the
//! job's ranks.

use super::{Communicator, Group};
use crate::crosshost::{Exchange, LocalMover};
use crate::data::types::DataType;
use crate::error::{Error, Result};
use crate::op::Op;

impl Exchange for Communicator {
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let mut all = vec![0u8; mine.len() * self.count()];
        Communicator::all_gather(self, mine, &mut all)?;
        Ok(all.chunks(mine.len().max(1)).map(<[u8]>::to_vec).collect())
    }
}

/// A host-local communicator as the mover: grouped sends and receives.
/// Its errors name ranks as the whole job knows them (`world[j]` is local
/// rank j's rank).
pub struct CommMover {
    pub comm: Communicator,
    pub world: Vec<usize>,
    stalled_on: Option<usize>,
}

impl CommMover {
    /// `world[j]`: local rank j's rank in the job.
    pub fn new(comm: Communicator, world: Vec<usize>) -> CommMover {
        CommMover {
            comm,
            world,
            stalled_on: None,
        }
    }
}

/// `text` with every "rank N" of the host-local communicator renamed to the
/// rank `world[N]` (other numbers are left alone).
fn in_world_ranks(text: &str, world: &[usize]) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("rank ") {
        out.push_str(&rest[..i + 5]);
        rest = &rest[i + 5..];
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        match rest[..digits]
            .parse::<usize>()
            .ok()
            .and_then(|n| world.get(n))
        {
            Some(w) => out.push_str(&w.to_string()),
            None => out.push_str(&rest[..digits]),
        }
        rest = &rest[digits..];
    }
    out.push_str(rest);
    out
}

/// The first "rank N" of `text`.
fn first_rank(text: &str) -> Option<usize> {
    let at = text.find("rank ")? + 5;
    let digits = text[at..].bytes().take_while(u8::is_ascii_digit).count();
    text[at..at + digits].parse().ok()
}

impl LocalMover for CommMover {
    fn local_rank(&self) -> usize {
        self.comm.rank()
    }
    fn stalled_on(&self) -> Option<usize> {
        self.stalled_on
    }
    fn local_size(&self) -> usize {
        self.comm.count()
    }
    unsafe fn exchange(
        &mut self,
        sends: &[(usize, *const u8, usize)],
        recvs: &[(usize, *mut u8, usize)],
    ) -> Result<()> {
        let mut g = Group::new();
        for &(p, ptr, len) in sends {
            // SAFETY: the caller keeps the buffers valid until we return.
            unsafe { g.push(&self.comm, Op::send(ptr, len, DataType::U8, p))? };
        }
        for &(p, ptr, len) in recvs {
            unsafe { g.push(&self.comm, Op::recv(ptr, len, DataType::U8, p))? };
        }
        g.execute().map_err(|e| {
            // A timeout names the ranks it waits on first ("sending to rank
            // 2, ..."): the first is the one the chain of waits follows.
            if let Error::Timeout { waiting_for, .. } = &e {
                self.stalled_on = first_rank(waiting_for).and_then(|r| self.world.get(r).copied());
            }
            let me = self
                .world
                .get(self.comm.rank())
                .copied()
                .unwrap_or(usize::MAX);
            Error::Remote {
                comm: "host-local phase".into(),
                rank: me,
                detail: in_world_ranks(&e.to_string(), &self.world),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn local_ranks_are_renamed_to_the_jobs() {
        let t = "communicator x (rank 1) timed out: receiving from rank 0, rank 12 (pid 7)";
        assert_eq!(
            super::in_world_ranks(t, &[4, 5]),
            "communicator x (rank 5) timed out: receiving from rank 4, rank 12 (pid 7)"
        );
    }

    #[test]
    fn the_first_rank_a_wait_names_is_found() {
        assert_eq!(
            super::first_rank("sending to rank 2, receiving from rank 0"),
            Some(2)
        );
        assert_eq!(super::first_rank("delivering earlier sends"), None);
        assert_eq!(super::first_rank("rank x"), None);
    }
}
