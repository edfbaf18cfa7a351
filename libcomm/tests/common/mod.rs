//! Helpers shared by libcomm's integration tests.

use libcomm::{Communicator, Config, UniqueId};
use std::thread;

/// A communicator of `n` ranks as threads of this process, each built with
/// `cfg` (initialised concurrently, as the ranks of a job are).
pub fn comms(n: usize, cfg: Config) -> Vec<Communicator> {
    let id = UniqueId::new().unwrap();
    thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let (id, cfg) = (&id, cfg.clone());
                s.spawn(move || Communicator::init_with_config(id, n, r, cfg).unwrap())
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Runs `f` on every communicator of `comms`, each on its own thread, and
/// waits for all of them.
pub fn each<F>(comms: &[Communicator], f: F)
where
    F: Fn(&Communicator) + Sync,
{
    thread::scope(|s| {
        for c in comms {
            let f = &f;
            s.spawn(move || f(c));
        }
    });
}
