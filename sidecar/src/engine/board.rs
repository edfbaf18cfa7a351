//! The recovery board across pods (`onRankFailure: ReplaceRank`).
//!
//! Ranks that use libcomm's `Resilient` meet on a directory, the recovery
//! board (`WEFT_RECOVERY_DIR`, docs/FAULT-TOLERANCE.md): who died (`dead`),
//! who is up and waiting to join (`ready-R-I`), the grow a replacement
//! should join (`grow-R-I`), an unexplained timeout (`report-R-I`). Under
//! `weft run --replace-failed` every rank sees one directory on one host.
//! In pods each pod has its own (in the volume the sidecar shares with the
//! workload), and the sidecars keep them the same:
//!
//! - files the pod's ranks write are sent to every peer sidecar, which
//!   writes them into its own pod's board;
//! - deaths are learnt by the sidecars: the pod's own ranks gone without
//!   destroying their communicators, the pod terminating while its ranks
//!   run, a peer sidecar gone silent. Each is written into `dead` and sent
//!   to every peer;
//! - a peer whose sidecar restarted (a replacement pod behind the same
//!   address: its [`rpc::BoardReply::boot`] changed) is sent everything again;
//! - a `report` makes every sidecar SIGKILL its pod's stopped (SIGSTOPped)
//!   ranks, so a frozen rank becomes a dead one that its pod replaces.
//!
//! A pod is the unit: the operator replaces a failed pod as a whole, so
//! when one of its ranks dies, all of them are named dead at the pod's
//! incarnation.
//!
//! The board's file names, its `dead` line, the bounds a peer's post must
//! keep and the atomic write are the protocol's, in [`weft_contract::board`]
//! (shared with `weft run`'s launcher and libcomm's `Resilient`). This
//! module keeps one pod's board and what each peer has of it; the engine
//! runs the relay and acts on deaths and reports in [`super::board_relay`].

use crate::log::log;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use weft_agent::rpc;
use weft_contract::board::{self, BoardError, Death};
use weft_contract::params;

/// A pod's ranks and incarnation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodRanks {
    pub offset: u32,
    pub count: u32,
    pub incarnation: u32,
}

impl PodRanks {
    /// The deaths that name this pod gone.
    pub fn deaths(&self) -> Vec<(u32, u32)> {
        (self.offset..self.offset.saturating_add(self.count))
            .map(|r| (r, self.incarnation))
            .collect()
    }
}

/// What this sidecar knows, and what each peer has acknowledged.
#[derive(Default)]
struct Known {
    entries: BTreeMap<String, String>,
    deaths: BTreeSet<(u32, u32)>,
    /// Per peer address: the entries and deaths it has acknowledged, and
    /// the boot id of the sidecar that acknowledged them.
    sent: HashMap<String, Sent>,
    /// Per peer address: its pod's ranks, from its heartbeats.
    peers: HashMap<String, PodRanks>,
    /// Our own pod has been named dead (said once).
    own_death_said: bool,
}

#[derive(Default, Clone)]
struct Sent {
    boot: u64,
    entries: BTreeMap<String, String>,
    deaths: BTreeSet<(u32, u32)>,
}

/// One pod's board and its relay state.
pub struct Board {
    dir: PathBuf,
    /// This pod's ranks.
    pub me: PodRanks,
    /// The job's world size (names with a larger rank are refused).
    world: u32,
    /// Random per sidecar start (see [`rpc::BoardReply::boot`]).
    pub boot: u64,
    known: Mutex<Known>,
    /// Bumped on every change: the senders wait on it.
    version: tokio::sync::watch::Sender<u64>,
    /// A rank process of this pod has attached (see [`Board::had_attach`]).
    attached: std::sync::atomic::AtomicBool,
}

/// What a peer's post brought: reports and deaths new to this sidecar.
pub type Accepted = (Vec<String>, Vec<(u32, u32)>);

/// What a post to a peer should carry.
pub struct Outgoing {
    pub post: rpc::BoardPost,
    entries: BTreeMap<String, String>,
    deaths: BTreeSet<(u32, u32)>,
}

impl Board {
    /// The board of this pod when the pod keeps one (`WEFT_RECOVERY_DIR`
    /// set: the operator sets it under `ReplaceRank`), with the pod's ranks
    /// from the pod contract. Creates the directory, open to the pod's
    /// containers (they may run as different users; the volume is the
    /// pod's own).
    pub fn from_env() -> Result<Option<Board>, String> {
        let Some(dir) = params::WEFT_RECOVERY_DIR.raw() else {
            return Ok(None);
        };
        let num = |p: params::Param<usize>| -> Result<u32, String> {
            let v = p.try_get().map_err(|e| e.to_string())?.ok_or_else(|| {
                format!(
                    "{} is set but {} is not",
                    params::WEFT_RECOVERY_DIR.name(),
                    p.name()
                )
            })?;
            u32::try_from(v).map_err(|_| format!("{} = {v} is too large", p.name()))
        };
        let me = PodRanks {
            offset: num(params::WEFT_RANK_OFFSET)?,
            count: num(params::WEFT_LOCAL_RANKS)?,
            incarnation: params::WEFT_INCARNATION
                .try_get()
                .map_err(|e| e.to_string())?
                .unwrap_or(0),
        };
        let world = num(params::WEFT_WORLD_SIZE)?;
        Board::new(PathBuf::from(dir), me, world).map(Some)
    }

    pub fn new(dir: PathBuf, me: PodRanks, world: u32) -> Result<Board, String> {
        if me.count == 0 || me.offset.saturating_add(me.count) > world {
            return Err(format!(
                "this pod's ranks {}..{} are not within the world of {world}",
                me.offset,
                me.offset.saturating_add(me.count)
            ));
        }
        create_dir(&dir)
            .map_err(|e| format!("creating the recovery board {}: {e}", dir.display()))?;
        let mut b = [0u8; 8];
        getrandom::fill(&mut b).map_err(|e| format!("getrandom: {e}"))?;
        let (version, _) = tokio::sync::watch::channel(0);
        let board = Board {
            dir,
            me,
            world,
            boot: u64::from_le_bytes(b) | 1,
            known: Mutex::new(Known::default()),
            version,
            attached: std::sync::atomic::AtomicBool::new(false),
        };
        // Deaths already on the board (a restarted sidecar) are known.
        board.lock().deaths = read_dead(&board.dir);
        Ok(board)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Known> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn bump(&self) {
        self.version.send_modify(|v| *v += 1);
    }

    /// A receiver that changes whenever there is something new to send.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.version.subscribe()
    }

    /// Reads the files this pod's ranks wrote; returns the names of reports
    /// new to this sidecar. Files written from peers read back unchanged.
    pub fn scan(&self) -> Vec<String> {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut found = Vec::new();
        for e in rd.flatten() {
            let Ok(name) = e.file_name().into_string() else {
                continue;
            };
            let Ok(entry) = board::classify(&name, self.world as usize) else {
                continue;
            };
            let Ok(body) = std::fs::read_to_string(e.path()) else {
                continue;
            };
            if board::check_body(&name, &body).is_ok() {
                found.push((name, entry, body));
            }
        }
        let mut reports = Vec::new();
        let mut k = self.lock();
        let mut changed = false;
        for (name, entry, body) in found {
            if !k.entries.contains_key(&name) && board::check_room(k.entries.len(), 1).is_err() {
                continue;
            }
            if board::replaces(k.entries.get(&name).map(String::as_str), &body) {
                if entry.is_report() {
                    reports.push(name.clone());
                }
                k.entries.insert(name, body);
                changed = true;
            }
        }
        drop(k);
        if changed {
            self.bump();
        }
        reports
    }

    /// Takes a peer's post: writes what is new into this pod's board.
    /// Returns the names of reports and the deaths new to this sidecar.
    pub fn accept(&self, post: &rpc::BoardPost) -> Result<Accepted, BoardError> {
        board::check_post_items(post.entries.len() + post.deaths.len())?;
        let world = self.world as usize;
        let mut ok = Vec::new();
        for e in &post.entries {
            let entry = board::classify(&e.name, world)?;
            board::check_body(&e.name, &e.body)?;
            ok.push((e.name.clone(), entry, e.body.clone()));
        }
        for d in &post.deaths {
            death(d.rank, d.incarnation).check(world)?;
        }
        let mut reports = Vec::new();
        let mut writes = Vec::new();
        {
            let mut k = self.lock();
            let fresh = ok.iter().filter(|e| !k.entries.contains_key(&e.0)).count();
            board::check_room(k.entries.len(), fresh)?;
            for (name, entry, body) in ok {
                if board::replaces(k.entries.get(&name).map(String::as_str), &body) {
                    if entry.is_report() {
                        reports.push(name.clone());
                    }
                    k.entries.insert(name.clone(), body.clone());
                    writes.push((name, body));
                }
            }
        }
        for (name, body) in writes {
            self.write(&name, &body);
        }
        let deaths: Vec<(u32, u32)> = post
            .deaths
            .iter()
            .map(|d| (d.rank, d.incarnation))
            .collect();
        let new = self.add_deaths(&deaths);
        if !reports.is_empty() || !new.is_empty() {
            self.bump();
        }
        Ok((reports, new))
    }

    /// Records deaths; rewrites `dead` when any is new. Returns the new ones.
    pub fn add_deaths(&self, deaths: &[(u32, u32)]) -> Vec<(u32, u32)> {
        let mut k = self.lock();
        let new: Vec<(u32, u32)> = deaths
            .iter()
            .copied()
            .filter(|d| k.deaths.insert(*d))
            .collect();
        if new.is_empty() {
            return new;
        }
        // Written under the lock: two writers never interleave their files.
        let body = board::dead_file(k.deaths.iter().map(|&(r, i)| death(r, i)));
        self.write(board::DEAD, &body);
        drop(k);
        self.bump();
        new
    }

    /// Names this pod's ranks dead (once): one of them died, or the pod is
    /// going away with them running. Returns whether this was news.
    pub fn own_death(&self) -> bool {
        {
            let mut k = self.lock();
            if k.own_death_said {
                return false;
            }
            k.own_death_said = true;
        }
        !self.add_deaths(&self.me.deaths()).is_empty()
    }

    /// A rank process of this pod attached to the sidecar.
    pub fn attached(&self) {
        self.attached
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether a rank process of this pod ever attached: a pod whose ranks
    /// all exited cleanly finished; one whose workload never attached failed
    /// before it could (or was deleted first).
    pub fn had_attach(&self) -> bool {
        self.attached.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Waits (at most `limit`) until every peer in `addrs` has taken
    /// everything this sidecar knows: before it exits.
    pub async fn flush(&self, addrs: &[String], limit: std::time::Duration) {
        let until = tokio::time::Instant::now() + limit;
        while tokio::time::Instant::now() < until {
            if addrs.iter().all(|a| self.outgoing(a, "").is_none()) {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }

    /// A peer's heartbeat said which ranks it holds. A higher incarnation
    /// than before at the same address is a replacement pod: its
    /// predecessor is gone (even if nobody said so: its node was lost and
    /// the replacement came up before the heartbeats timed out). Returns
    /// the deaths that were news.
    ///
    /// Only deaths of an incarnation this sidecar had seen alive are
    /// returned (its ranks may be waiting on them); a replacement seen for
    /// the first time names its predecessors dead on the board all the same.
    pub fn peer_ranks(&self, addr: &str, r: PodRanks) -> Vec<(u32, u32)> {
        if r.count == 0 || r.offset.saturating_add(r.count) > self.world {
            return Vec::new();
        }
        let before = self.lock().peers.insert(addr.to_string(), r);
        let of = |p: PodRanks, incs: std::ops::Range<u32>| -> Vec<(u32, u32)> {
            incs.flat_map(|incarnation| PodRanks { incarnation, ..p }.deaths())
                .collect()
        };
        match before {
            Some(b) if b.incarnation < r.incarnation => {
                self.add_deaths(&of(b, b.incarnation..r.incarnation))
            }
            None if r.incarnation > 0 => {
                self.add_deaths(&of(r, 0..r.incarnation));
                Vec::new()
            }
            _ => Vec::new(),
        }
    }

    /// The peer at `addr` went silent: names its pod's ranks dead. Returns
    /// `Some(true)` when that was news, `Some(false)` when its death was
    /// already known (said by its own sidecar while terminating, or by
    /// another peer), `None` when its ranks are unknown (it never answered).
    pub fn peer_lost(&self, addr: &str) -> Option<bool> {
        let r = *self.lock().peers.get(addr)?;
        Some(!self.add_deaths(&r.deaths()).is_empty())
    }

    /// What `addr` has not acknowledged yet (None: nothing).
    pub fn outgoing(&self, addr: &str, from_host: &str) -> Option<Outgoing> {
        let k = self.lock();
        let sent = k.sent.get(addr).cloned().unwrap_or_default();
        let entries: BTreeMap<String, String> = k
            .entries
            .iter()
            .filter(|(n, b)| sent.entries.get(*n) != Some(*b))
            .map(|(n, b)| (n.clone(), b.clone()))
            .take(board::MAX_POST_ITEMS / 2)
            .collect();
        let deaths: BTreeSet<(u32, u32)> = k
            .deaths
            .difference(&sent.deaths)
            .copied()
            .take(board::MAX_POST_ITEMS / 2)
            .collect();
        if entries.is_empty() && deaths.is_empty() {
            return None;
        }
        let post = rpc::BoardPost {
            from_host: from_host.to_string(),
            entries: entries
                .iter()
                .map(|(n, b)| rpc::BoardEntry {
                    name: n.clone(),
                    body: b.clone(),
                })
                .collect(),
            deaths: deaths
                .iter()
                .map(|&(rank, incarnation)| rpc::Death { rank, incarnation })
                .collect(),
        };
        Some(Outgoing {
            post,
            entries,
            deaths,
        })
    }

    /// `addr` (whose sidecar has boot id `boot`) took `out`. A new boot id
    /// means a new sidecar with an empty board: forget what the old one had.
    /// Returns whether everything must be sent again.
    pub fn acknowledged(&self, addr: &str, boot: u64, out: Outgoing) -> bool {
        let mut k = self.lock();
        let s = k.sent.entry(addr.to_string()).or_default();
        let restarted = s.boot != 0 && s.boot != boot;
        if restarted || s.boot == 0 {
            *s = Sent {
                boot,
                ..Sent::default()
            };
        }
        if restarted {
            return true;
        }
        s.entries.extend(out.entries);
        s.deaths.extend(out.deaths);
        false
    }

    /// Makes the next send to `addr` carry everything (its sidecar may have
    /// restarted while unreachable).
    pub fn forget_peer(&self, addr: &str) {
        self.lock().sent.remove(addr);
    }

    /// Writes one file of the board whole; a failure is logged (the relay
    /// goes on: the next change writes the file again).
    fn write(&self, name: &str, body: &str) {
        if let Err(e) = board::write_atomic(&self.dir, name, body) {
            log(&format!(
                "recovery board: writing {}: {e}",
                self.dir.join(name).display()
            ));
        }
    }
}

fn create_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    match std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o777)
        .create(dir)
    {
        Ok(()) => {
            // The umask narrowed it; the pod's other containers write here too.
            let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777));
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// A death this sidecar learnt: the pod's replacement is coming (the
/// operator replaces a pod until its budget is spent, then the job fails).
fn death(rank: u32, incarnation: u32) -> Death {
    Death {
        rank: rank as usize,
        incarnation,
        replaced: true,
    }
}

/// The deaths on the board already (a restarted sidecar's).
fn read_dead(dir: &Path) -> BTreeSet<(u32, u32)> {
    board::read_dead(dir)
        .into_iter()
        .filter_map(|d| Some((u32::try_from(d.rank).ok()?, d.incarnation)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn board(world: u32, offset: u32) -> (Board, PathBuf) {
        let dir = std::env::temp_dir().join(format!(
            "weft-board-test-{}-{offset}-{}",
            std::process::id(),
            rand_tag()
        ));
        let me = PodRanks {
            offset,
            count: 1,
            incarnation: 0,
        };
        (Board::new(dir.clone(), me, world).unwrap(), dir)
    }

    fn rand_tag() -> u64 {
        let mut b = [0u8; 8];
        getrandom::fill(&mut b).unwrap();
        u64::from_le_bytes(b)
    }

    /// Two pods' boards converge through posts; a rewritten grow wins only
    /// with a higher sequence; deaths are a union written to `dead`.
    #[test]
    fn two_boards_converge() {
        let (a, da) = board(4, 0);
        let (b, db) = board(4, 1);
        std::fs::write(da.join("ready-0-1"), "").unwrap();
        std::fs::write(da.join("grow-2-1"), "1 4 3 7 abcd").unwrap();
        std::fs::write(da.join(".grow-2-1.123"), "x").unwrap(); // a temporary file
        std::fs::write(da.join("torch-store-k"), "host 29500").unwrap();
        assert!(a.scan().is_empty());
        let out = a.outgoing("b", "A").unwrap();
        assert_eq!(out.post.entries.len(), 3);
        b.accept(&out.post).unwrap();
        assert!(!a.acknowledged("b", b.boot, out));
        assert!(a.outgoing("b", "A").is_none(), "all acknowledged");
        assert_eq!(
            std::fs::read_to_string(db.join("grow-2-1")).unwrap(),
            "1 4 3 7 abcd"
        );
        assert!(db.join("ready-0-1").exists());
        assert_eq!(
            std::fs::read_to_string(db.join("torch-store-k")).unwrap(),
            "host 29500"
        );
        assert!(!db.join(".grow-2-1.123").exists());

        // An older grow does not overwrite a newer one; a newer one does.
        std::fs::write(db.join("grow-2-1"), "2 4 3 8 ef").unwrap();
        b.scan();
        let stale = rpc::BoardPost {
            entries: vec![rpc::BoardEntry {
                name: "grow-2-1".into(),
                body: "1 4 3 7 abcd".into(),
            }],
            ..Default::default()
        };
        b.accept(&stale).unwrap();
        assert_eq!(
            std::fs::read_to_string(db.join("grow-2-1")).unwrap(),
            "2 4 3 8 ef"
        );
        let out = b.outgoing("a", "B").unwrap();
        a.accept(&out.post).unwrap();
        assert_eq!(
            std::fs::read_to_string(da.join("grow-2-1")).unwrap(),
            "2 4 3 8 ef"
        );

        // Deaths: a union, `dead` in the launcher's format, news said once.
        assert_eq!(a.add_deaths(&[(2, 0)]), vec![(2, 0)]);
        assert!(a.add_deaths(&[(2, 0)]).is_empty());
        let out = a.outgoing("b", "A").unwrap();
        let (_, new) = b.accept(&out.post).unwrap();
        assert_eq!(new, vec![(2, 0)]);
        assert_eq!(
            std::fs::read_to_string(db.join("dead")).unwrap(),
            "2 0 replaced\n"
        );
        assert!(b.own_death());
        assert!(!b.own_death(), "said once");
        assert_eq!(
            std::fs::read_to_string(db.join("dead")).unwrap(),
            "1 0 replaced\n2 0 replaced\n"
        );
        let _ = (std::fs::remove_dir_all(da), std::fs::remove_dir_all(db));
    }

    /// A peer that restarted (new boot id) is sent everything again.
    #[test]
    fn a_restarted_peer_gets_everything() {
        let (a, da) = board(2, 0);
        a.add_deaths(&[(1, 0)]);
        let out = a.outgoing("p", "A").unwrap();
        assert!(!a.acknowledged("p", 7, out));
        assert!(a.outgoing("p", "A").is_none());
        let out = a.outgoing("p", "A");
        assert!(out.is_none());
        // The same address answers with another boot id.
        a.add_deaths(&[(1, 1)]);
        let out = a.outgoing("p", "A").unwrap();
        assert!(a.acknowledged("p", 9, out), "restarted");
        let out = a.outgoing("p", "A").unwrap();
        assert_eq!(out.post.deaths.len(), 2, "everything again");
        let _ = std::fs::remove_dir_all(da);
    }

    /// Hostile posts are refused whole, and nothing of them is written.
    #[test]
    fn hostile_posts_are_refused() {
        let (a, da) = board(4, 0);
        let post = |name: &str, body: usize| rpc::BoardPost {
            entries: vec![rpc::BoardEntry {
                name: name.into(),
                body: "x".repeat(body),
            }],
            ..Default::default()
        };
        assert!(a.accept(&post("../../etc/passwd", 1)).is_err());
        assert!(a.accept(&post("dead", 1)).is_err());
        assert!(a.accept(&post("ready-9-0", 1)).is_err());
        assert!(a.accept(&post("report-1-0", board::MAX_BODY + 1)).is_err());
        let many = rpc::BoardPost {
            deaths: vec![rpc::Death::default(); board::MAX_POST_ITEMS + 1],
            ..Default::default()
        };
        assert!(a.accept(&many).is_err());
        let far = rpc::BoardPost {
            deaths: vec![rpc::Death {
                rank: 4,
                incarnation: 0,
            }],
            ..Default::default()
        };
        assert!(a.accept(&far).is_err());
        let names: Vec<_> = std::fs::read_dir(&da).unwrap().flatten().collect();
        assert!(names.is_empty(), "nothing written");
        let _ = std::fs::remove_dir_all(da);
    }

    #[test]
    fn peers_named_dead_on_silence() {
        let (a, da) = board(4, 0);
        assert_eq!(a.peer_lost("x:1"), None, "never answered: ranks unknown");
        let pod = PodRanks {
            offset: 2,
            count: 2,
            incarnation: 3,
        };
        // First seen at incarnation 3: incarnations 0..3 are named dead on
        // the board, but nothing here waited on them.
        assert!(a.peer_ranks("x:1", pod).is_empty());
        assert_eq!(read_dead(&da).len(), 6);
        assert!(a.peer_ranks("x:1", pod).is_empty());
        assert_eq!(a.peer_lost("x:1"), Some(true));
        assert_eq!(a.peer_lost("x:1"), Some(false), "already known");
        let dead = std::fs::read_to_string(da.join("dead")).unwrap();
        assert!(
            dead.contains("2 3 replaced\n") && dead.contains("3 3 replaced\n"),
            "{dead}"
        );
        assert_eq!(dead.lines().count(), 8, "{dead}");
        // The replacement answers: nothing new about incarnation 3.
        let next = PodRanks {
            incarnation: 4,
            ..pod
        };
        assert!(a.peer_ranks("x:1", next).is_empty(), "3 was known dead");
        let _ = std::fs::remove_dir_all(da);
    }
}
