//! The LL one-shot's reuse of its area across operations.
//!
//! LL operations alternate between two parity halves of the LL area; before
//! pushing into a half again, a rank must know that every peer it pushes to
//! has read what the operation two back left there. [`LlHistory`] keeps what
//! one rank knows and says which peers its next kernel must ask (and the
//! count of finished LL blocks they must have reached). The model test below
//! runs random schedules of LL operations on 2-8 ranks against this rule.

use super::abi::{K_BROADCAST, K_REDUCE};

/// The ranks an LL operation of `kind` on rank `me` of `n` pushes to and
/// receives from, as bit masks.
pub(super) fn ll_peers(kind: i32, root: usize, me: usize, n: usize) -> (u64, u64) {
    let others = ((1u64 << n) - 1) & !(1 << me);
    match kind {
        K_BROADCAST if me == root => (others, 0),
        K_BROADCAST => (0, 1 << root),
        K_REDUCE if me == root => (0, others),
        K_REDUCE => (1 << root, 0),
        _ => (others, others),
    }
}

/// What this rank knows about its peers' use of the LL area. Operation k
/// writes parity half k % 2, so a peer must have finished operation k - 2
/// before this rank pushes into it again. Having received that peer's data
/// in operation k - 1 proves it (the peer pushed it after its kernel k - 2
/// ended); for any other peer pushed to, the kernel reads the peer's count of
/// finished LL blocks until it reaches the blocks of operations 0 ..= k - 2
/// (every rank launches the same blocks per operation).
#[derive(Debug, Default, Clone, PartialEq)]
pub(super) struct LlHistory {
    /// LL operations so far.
    pub(super) ops: u64,
    /// Blocks of all of them, and of the last one.
    pub(super) blocks: u64,
    pub(super) last_blocks: u64,
    /// Peers the last one received data from.
    pub(super) last_received: u64,
}

impl LlHistory {
    /// Records the next operation (pushing to `sends`, receiving from
    /// `receives`, `blocks` blocks) and returns the peers its kernel must ask
    /// and the count they must have reached.
    pub(super) fn next(&mut self, sends: u64, receives: u64, blocks: u64) -> (u64, u64) {
        let check = if self.ops >= 2 {
            sends & !self.last_received
        } else {
            0
        };
        let need = self.blocks - self.last_blocks;
        self.ops += 1;
        self.blocks += blocks;
        self.last_blocks = blocks;
        self.last_received = receives;
        (check, if check == 0 { 0 } else { need })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::abi::{K_ALLGATHER, K_ALLREDUCE, K_ALLTOALL, K_REDUCESCATTER, MAX_RANKS};

    /// A peer is asked whether it finished the LL operation two back exactly
    /// when the operation in between brought nothing from it.
    #[test]
    fn ll_history_asks_only_peers_that_gave_no_sign() {
        let n = 4;
        // Rank 0 all-reduces: every peer's data arrives each time.
        let mut h = LlHistory::default();
        for b in [1, 3, 2, 5] {
            let (s, r) = ll_peers(K_ALLREDUCE, 0, 0, n);
            assert_eq!(h.next(s, r, b), (0, 0));
        }
        // Rank 0 broadcasts from itself after that: nothing comes back.
        let (s, r) = ll_peers(K_BROADCAST, 0, 0, n);
        assert_eq!((s, r), (0b1110, 0));
        // Op 4: the last op (an all-reduce) received from everyone.
        assert_eq!(h.next(s, r, 4), (0, 0));
        // Op 5: ask every peer for ops 0..=3 (1 + 3 + 2 + 5 blocks).
        assert_eq!(h.next(s, r, 4), (0b1110, 11));
        // Op 6: ops 0..=4.
        assert_eq!(h.next(s, r, 1), (0b1110, 15));
        // Its receivers only receive: they never ask.
        let mut g = LlHistory::default();
        for _ in 0..4 {
            let (s, r) = ll_peers(K_BROADCAST, 0, 2, n);
            assert_eq!((s, r), (0, 0b0001));
            assert_eq!(g.next(s, r, 2), (0, 0));
        }
        // Reduce to rank 3: rank 1 pushes to the root only and asks it from
        // the third op on.
        let mut h = LlHistory::default();
        let (s, r) = ll_peers(K_REDUCE, 3, 1, n);
        assert_eq!((s, r), (0b1000, 0));
        assert_eq!(h.next(s, r, 2), (0, 0));
        assert_eq!(h.next(s, r, 2), (0, 0));
        assert_eq!(h.next(s, r, 2), (0b1000, 2));
    }

    /// The next value of a xorshift64 generator (state never 0).
    fn xorshift(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    /// A model of the LL area's reuse across processes: ranks run the same
    /// LL operations at their own pace (any interleaving a random schedule
    /// picks), each one checking, pushing and receiving as the kernel does
    /// with the `LlHistory` of its rank. Returns the first slot overwritten
    /// before its receiver read it, or a deadlock.
    fn ll_model(n: usize, ops: &[(i32, usize, u64)], seed: u64, check: bool) -> Result<(), String> {
        #[derive(Clone, Copy, PartialEq)]
        enum Phase {
            Check,
            Push,
            Receive,
        }
        // slot[receiver][parity][sender] = (operation, read yet)
        let mut slot = vec![[[None::<(usize, bool)>; MAX_RANKS]; 2]; n];
        let mut count = vec![0u64; n];
        let mut pc = vec![0usize; n];
        let mut phase = vec![Phase::Check; n];
        let mut hist = vec![LlHistory::default(); n];
        // (sends, receives, peers to ask, their count) of each rank's current op.
        let mut plan = vec![None::<(u64, u64, u64, u64)>; n];
        let mut rng = seed | 1;
        loop {
            let live: Vec<usize> = (0..n).filter(|&r| pc[r] < ops.len()).collect();
            if live.is_empty() {
                return Ok(());
            }
            // Every rank that can move, in a random order; none: deadlock.
            let mut moved = false;
            let start = xorshift(&mut rng) as usize;
            for i in 0..live.len() {
                let r = live[(start + i) % live.len()];
                let k = pc[r];
                let (kind, root, blocks) = ops[k];
                let par = k % 2;
                match phase[r] {
                    Phase::Check => {
                        let (_, _, c, need) = *plan[r].get_or_insert_with(|| {
                            let (sends, receives) = ll_peers(kind, root, r, n);
                            let (c, need) = hist[r].next(sends, receives, blocks);
                            (sends, receives, if check { c } else { 0 }, need)
                        });
                        if (0..n).all(|d| c >> d & 1 == 0 || count[d] >= need) {
                            phase[r] = Phase::Push;
                            moved = true;
                        }
                    }
                    Phase::Push => {
                        let sends = plan[r].unwrap().0;
                        for d in (0..n).filter(|d| sends >> d & 1 == 1) {
                            if let Some((j, false)) = slot[d][par][r] {
                                return Err(format!(
                                    "rank {r} overwrote op {j}'s data for rank {d} (op {k}) before it was read"
                                ));
                            }
                            slot[d][par][r] = Some((k, false));
                        }
                        phase[r] = Phase::Receive;
                        moved = true;
                    }
                    Phase::Receive => {
                        let receives = plan[r].unwrap().1;
                        let from: Vec<usize> = (0..n).filter(|s| receives >> s & 1 == 1).collect();
                        if from
                            .iter()
                            .all(|&s| matches!(slot[r][par][s], Some((j, _)) if j == k))
                        {
                            for s in from {
                                slot[r][par][s] = Some((k, true));
                            }
                            count[r] += blocks;
                            pc[r] += 1;
                            plan[r] = None;
                            phase[r] = Phase::Check;
                            moved = true;
                        }
                    }
                }
                if moved {
                    break;
                }
            }
            if !moved {
                return Err(format!("deadlock at {pc:?}"));
            }
        }
    }

    /// The reuse rule holds under random schedules for random sequences of
    /// every kind of LL operation, and the model has teeth: without the
    /// count check a broadcast root overwrites unread data (the hang the
    /// first GPU build had).
    #[test]
    fn ll_reuse_never_overwrites_unread_data() {
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |m: u64| xorshift(&mut rng) % m;
        let kinds = [
            K_ALLREDUCE,
            K_BROADCAST,
            K_REDUCE,
            K_ALLGATHER,
            K_REDUCESCATTER,
            K_ALLTOALL,
        ];
        for case in 0..300 {
            let n = 2 + next(7) as usize;
            let ops: Vec<(i32, usize, u64)> = (0..2 + next(12))
                .map(|_| {
                    (
                        kinds[next(6) as usize],
                        next(n as u64) as usize,
                        1 + next(32),
                    )
                })
                .collect();
            for seed in 0..8 {
                if let Err(e) = ll_model(n, &ops, case * 8 + seed + 1, true) {
                    panic!("case {case} (n={n}, ops={ops:?}, seed {seed}): {e}");
                }
            }
        }
        for unchecked in [[(K_BROADCAST, 0usize, 2u64); 6], [(K_REDUCE, 2, 1); 6]] {
            let caught = (1..50).any(|seed| ll_model(3, &unchecked, seed, false).is_err());
            assert!(
                caught,
                "without the check the model should find the overwrite"
            );
        }
    }
}
