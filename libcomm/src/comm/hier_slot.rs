//! A communicator's hierarchy slot (`hier.rs` builds and drives it): the
//! hierarchy once built, kept as the parent's record holds it, and its
//! two communicators as [`Sub`]s, which the device watch, abort and
//! destroy reach without the hierarchy's lock (a call building it holds
//! that) and without naming the communicator's record (which holds this).

use crate::sys::lock;
use std::any::Any;
use std::sync::{Arc, Mutex, Weak};

/// A communicator of the hierarchy, as the parent's slot needs it.
pub(crate) trait Sub: Send + Sync {
    /// Why it failed, or a failure a peer raised on it (None: it works).
    fn failure_text(&self) -> Option<String>;
    /// Its label (`<parent>.host<h>`, `<parent>.rail<l>`).
    fn label(&self) -> &str;
    /// Aborts it: its kernels and the flags its GPU waits on are released.
    fn abort(&self, reason: &str);
}

/// A communicator of the hierarchy and the parent's ranks of it (by its rank).
type Member = (Weak<dyn Sub>, Vec<usize>);

/// A communicator's hierarchy slot.
#[derive(Default)]
pub(crate) struct Slot {
    pub(super) state: Mutex<State>,
    /// The two communicators, with the parent's ranks of each (by its
    /// rank), outside `state`.
    subs: Mutex<Vec<Member>>,
}

#[derive(Default)]
pub(super) enum State {
    #[default]
    Untried,
    /// One host, uneven hosts, one rank a host, switched off, or not built.
    Off,
    /// The hierarchy (`hier::Hier`, kept opaque here).
    On(Arc<dyn Any + Send + Sync>),
}

impl Slot {
    /// Records the two communicators and the parent's ranks of each.
    pub(super) fn set_subs(&self, subs: Vec<Member>) {
        *lock(&self.subs) = subs;
    }

    /// A failure of either communicator, described for the parent: its
    /// ranks renumbered as the parent's (its own errors number them from 0).
    pub(super) fn sub_failure(&self) -> Option<String> {
        let subs: Vec<(Arc<dyn Sub>, Vec<usize>)> = lock(&self.subs)
            .iter()
            .filter_map(|(s, m)| Some((s.upgrade()?, m.clone())))
            .collect();
        subs.into_iter().find_map(|(s, members)| {
            let why = s.failure_text()?;
            Some(format!(
                "across hosts, on its communicator {} of ranks {members:?}: {}",
                s.label(),
                renumber(&why, &members)
            ))
        })
    }

    /// Aborts both communicators (the parent failed or was aborted).
    pub(crate) fn release(&self, reason: &str) {
        let subs: Vec<Arc<dyn Sub>> = lock(&self.subs)
            .iter()
            .filter_map(|(s, _)| s.upgrade())
            .collect();
        for s in subs {
            s.abort(reason);
        }
    }

    /// Destroys both communicators (the parent is being destroyed; their
    /// queued device work runs first, as the parent's does).
    pub(crate) fn close(&self) {
        let h = std::mem::replace(&mut *lock(&self.state), State::Off);
        lock(&self.subs).clear();
        drop(h);
    }
}

/// `text` (an error of a sub-communicator of `members`, parent ranks by
/// its rank) with every "rank i" of it written as the parent's rank, and
/// "rank i of n" as "rank m of the parent's", so the error names the rank
/// the user knows.
fn renumber(text: &str, members: &[usize]) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("rank ") {
        let word = !rest[..at].ends_with(|c: char| c.is_alphanumeric());
        out.push_str(&rest[..at + 5]);
        rest = &rest[at + 5..];
        if !word {
            continue;
        }
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        let mapped = rest[..digits]
            .parse::<usize>()
            .ok()
            .and_then(|i| members.get(i));
        match mapped {
            Some(m) => {
                out.push_str(&m.to_string());
                rest = &rest[digits..];
                // "of n": the sub-communicator's size is not the user's.
                let of = format!(" of {}", members.len());
                if rest.starts_with(&of)
                    && !rest[of.len()..].starts_with(|c: char| c.is_ascii_digit())
                {
                    out.push_str(" of its sub-communicator");
                    rest = &rest[of.len()..];
                }
            }
            None => {
                out.push_str(&rest[..digits]);
                rest = &rest[digits..];
            }
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::renumber;

    #[test]
    fn a_sub_communicators_ranks_are_named_as_the_parents() {
        let rail = [1, 3];
        assert_eq!(
            renumber(
                "communicator j.rail1 (rank 0 of 2): rank 1 closed the connection",
                &rail
            ),
            "communicator j.rail1 (rank 1 of its sub-communicator): rank 3 closed the connection"
        );
        // Numbers past its size, other words and "ranks" stay.
        assert_eq!(
            renumber("rank 7 of 20; ranks 0, 1; frank 1", &rail),
            "rank 7 of 20; ranks 0, 1; frank 1"
        );
        assert_eq!(renumber("rank 1 of 25", &rail), "rank 3 of 25");
        assert_eq!(renumber("no rank here", &rail), "no rank here");
        assert_eq!(renumber("rank ", &rail), "rank ");
    }
}
