//! What the progress engine executes: one [`Call`] per network phase of a
//! collective, a list of chunk transfers ([`Step`]) with their dependencies.
//!
//! A step moves one chunk to or from one peer. Steps to one peer in one
//! direction (a lane) are posted in list order, which both sides share, so
//! the i-th send on a lane meets the peer's i-th receive. A step may wait for
//! an earlier step (a forward waits for its receive; a receive into a block
//! waits until the send of that block's old contents is done) and for a flag
//! word (the producer has made the chunk ready); when done it may raise a
//! flag word (the consumer may use the chunk). Several steps of a lane are in
//! flight at once, up to the call's window.

use crate::data::types::{DataType, ReduceOp};

/// What a step does with its chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepOp {
    /// Send the chunk.
    Send,
    /// Receive into the chunk.
    Recv,
    /// Receive into a staging slot, then combine into the chunk
    /// (`chunk = with op received`, `with` the chunk itself by default).
    RecvReduce,
}

/// One chunk transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// The peer's rank (never this rank).
    pub peer: usize,
    pub op: StepOp,
    /// Which of the call's buffers, and the bytes in it.
    pub buf: usize,
    pub off: usize,
    pub len: usize,
    /// A reducing receive's other operand when it is not the chunk itself:
    /// (buffer, byte offset) of `len` bytes (an out-of-place ring reads
    /// this rank's input there and writes the sum into the chunk, with no
    /// copy of the input first).
    pub with: Option<(usize, usize)>,
    /// An earlier step (index) that must be done first.
    pub after: Option<usize>,
    /// A flag word that must have reached a value first.
    pub ready: Option<(usize, u64)>,
    /// Raised when this step is done (words rise in step order: a word
    /// shows the value of the last of its steps such that all before are done).
    pub publish: Option<(usize, u64)>,
}

impl Step {
    pub fn new(peer: usize, op: StepOp, buf: usize, off: usize, len: usize) -> Step {
        Step {
            peer,
            op,
            buf,
            off,
            len,
            with: None,
            after: None,
            ready: None,
            publish: None,
        }
    }
}

/// A host-memory buffer a call's steps name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallBuf {
    pub ptr: usize,
    pub len: usize,
}

/// One network phase for the engine.
#[derive(Debug, Clone)]
pub struct Call {
    pub steps: Vec<Step>,
    pub bufs: Vec<CallBuf>,
    /// How received chunks combine (for [`StepOp::RecvReduce`]; avg and
    /// pre-multiplied sums combine by summing).
    pub reduce: Option<(DataType, ReduceOp)>,
    /// Every message of the call carries it; peers must agree.
    pub tag: u32,
    /// Steps in flight per lane, at most.
    pub window: usize,
    /// Raised once every step is done.
    pub done: Option<(usize, u64)>,
}

impl Call {
    /// Checks what the engine relies on: steps inside their buffers, earlier
    /// dependencies, a reduction for reducing receives, not to `me`.
    pub fn check(&self, me: usize) -> Result<(), String> {
        for (i, s) in self.steps.iter().enumerate() {
            let b = self
                .bufs
                .get(s.buf)
                .ok_or_else(|| format!("step {i} names buffer {} of {}", s.buf, self.bufs.len()))?;
            if s.off.checked_add(s.len).is_none_or(|e| e > b.len) {
                return Err(format!(
                    "step {i}: {} bytes at {} outside its buffer of {}",
                    s.len, s.off, b.len
                ));
            }
            if s.after.is_some_and(|a| a >= i) {
                return Err(format!("step {i} waits for a later step"));
            }
            if s.peer == me {
                return Err(format!("step {i} sends to this rank itself"));
            }
            if let Some((wb, wo)) = s.with {
                let w = self.bufs.get(wb).ok_or_else(|| {
                    format!("step {i} reduces with buffer {wb} of {}", self.bufs.len())
                })?;
                if s.op != StepOp::RecvReduce {
                    return Err(format!("step {i} has an operand but does not reduce"));
                }
                if wo.checked_add(s.len).is_none_or(|e| e > w.len) {
                    return Err(format!(
                        "step {i}: its operand of {} bytes at {wo} lies outside its buffer of {}",
                        s.len, w.len
                    ));
                }
            }
            if s.op == StepOp::RecvReduce {
                let (dt, _) = self
                    .reduce
                    .ok_or_else(|| format!("step {i} reduces without a reduction"))?;
                if s.len % dt.size() != 0 {
                    return Err(format!("step {i}: {} bytes of {}", s.len, dt.name()));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(step: Step) -> Call {
        Call {
            steps: vec![step],
            bufs: vec![
                CallBuf {
                    ptr: 0x1000,
                    len: 64,
                },
                CallBuf {
                    ptr: 0x2000,
                    len: 32,
                },
            ],
            reduce: Some((DataType::F32, ReduceOp::Sum)),
            tag: 0,
            window: 1,
            done: None,
        }
    }

    #[test]
    fn a_reducing_receives_operand_must_lie_in_a_buffer_and_only_reductions_have_one() {
        let mut s = Step::new(1, StepOp::RecvReduce, 0, 0, 32);
        s.with = Some((1, 0));
        assert_eq!(call(s.clone()).check(0), Ok(()));
        s.with = Some((1, 4));
        let e = call(s.clone()).check(0).unwrap_err();
        assert!(e.contains("outside its buffer"), "{e}");
        s.with = Some((2, 0));
        let e = call(s.clone()).check(0).unwrap_err();
        assert!(e.contains("buffer 2 of 2"), "{e}");
        let mut r = Step::new(1, StepOp::Recv, 0, 0, 32);
        r.with = Some((1, 0));
        let e = call(r).check(0).unwrap_err();
        assert!(e.contains("does not reduce"), "{e}");
    }
}
