//! The recovery board's protocol: the files that the launcher (`weft run
//! --replace-failed`), the sidecars (pods under `onRankFailure:
//! ReplaceRank`) and libcomm's `Resilient` ranks meet on, in the directory
//! `WEFT_RECOVERY_DIR` (docs/FAULT-TOLERANCE.md).
//!
//! - [`DEAD`]: one [`Death`] a line, `RANK INCARNATION replaced|final`,
//!   written by the launcher or a sidecar, read by the ranks and by a
//!   restarted sidecar;
//! - [`RankFile`]s, `ready-R-I`, `grow-R-I`, `report-R-I`, written by the
//!   ranks;
//! - any other file a program keeps there (the PyTorch example's
//!   `torch-store-*`), relayed between pods as it is when its name is
//!   [`classify`]d safe.
//!
//! Every file is written whole ([`write_atomic`]: a temporary file, then a
//! rename), so a reader never sees half of one. The bounds ([`MAX_NAME`],
//! [`MAX_BODY`], ...) are what the sidecars accept from each other: a
//! hostile peer cannot write outside the board or fill the pod's volume.
//! Bytes on disk and on the wire are pinned by this module's tests (Python
//! programs read the board too).

use std::fmt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// The file of deaths.
pub const DEAD: &str = "dead";
/// Longest board file name a sidecar relays.
pub const MAX_NAME: usize = 128;
/// Longest file body a sidecar relays (a grow id line is ~300 bytes; a
/// report a clipped error message).
pub const MAX_BODY: usize = 4096;
/// Highest incarnation accepted in a name or a death from a peer.
pub const MAX_INCARNATION: u32 = 1 << 20;
/// Most files one sidecar keeps: a real board holds a few per rank and
/// recovery.
pub const MAX_ENTRIES: usize = 16384;
/// Most files and deaths one post between sidecars may carry.
pub const MAX_POST_ITEMS: usize = 4096;

/// Why a name, a body, a line or a post is not the board's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BoardError {
    /// Empty, over [`MAX_NAME`], starting with a dot (a temporary file),
    /// [`DEAD`] (the launcher's and sidecars' own), or with a character
    /// outside `[A-Za-z0-9._-]` (a path). The name, clipped.
    UnsafeName(String),
    /// `ready-`, `grow-` or `report-` not followed by `RANK-INCARNATION`.
    MalformedName(String),
    /// A rank outside the job's world.
    RankOutOfRange { rank: usize, world: usize },
    /// An incarnation over [`MAX_INCARNATION`].
    IncarnationTooLarge(u32),
    /// A body over [`MAX_BODY`].
    BodyTooLarge { name: String, len: usize },
    /// A post with more than [`MAX_POST_ITEMS`] files and deaths.
    TooManyItems(usize),
    /// The board would hold more than [`MAX_ENTRIES`] files.
    Full,
    /// A line of [`DEAD`] that is not `RANK INCARNATION replaced|final`.
    MalformedDeath(String),
}

impl fmt::Display for BoardError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BoardError::UnsafeName(n) => write!(f, "not a board entry name: {n:?}"),
            BoardError::MalformedName(n) => {
                write!(
                    f,
                    "not a board entry name: {n:?} (expected KIND-RANK-INCARNATION)"
                )
            }
            BoardError::RankOutOfRange { rank, world } => {
                write!(f, "rank {rank} is not a rank of this job (world {world})")
            }
            BoardError::IncarnationTooLarge(i) => {
                write!(f, "incarnation {i} is over {MAX_INCARNATION}")
            }
            BoardError::BodyTooLarge { name, len } => {
                write!(f, "entry {name} is over {MAX_BODY} bytes ({len})")
            }
            BoardError::TooManyItems(n) => {
                write!(f, "more than {MAX_POST_ITEMS} entries in one post ({n})")
            }
            BoardError::Full => write!(f, "the board would hold more than {MAX_ENTRIES} entries"),
            BoardError::MalformedDeath(l) => {
                write!(
                    f,
                    "not a death line (RANK INCARNATION replaced|final): {l:?}"
                )
            }
        }
    }
}

impl std::error::Error for BoardError {}

/// Up to 64 characters of hostile input, for an error message.
fn clip(s: &str) -> String {
    s.chars().take(64).collect()
}

/// What one rank's incarnation says on the board.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `ready-R-I` (empty): up, waiting to join.
    Ready,
    /// `grow-R-I`: the grow the replacement should join.
    Grow,
    /// `report-R-I`: a failure the rank could not explain (a timeout): the
    /// launcher, or every sidecar, looks for a stopped rank.
    Report,
}

impl Kind {
    const ALL: [Kind; 3] = [Kind::Ready, Kind::Grow, Kind::Report];

    fn prefix(self) -> &'static str {
        match self {
            Kind::Ready => "ready",
            Kind::Grow => "grow",
            Kind::Report => "report",
        }
    }
}

/// A file of one rank's incarnation: `KIND-RANK-INCARNATION`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankFile {
    pub kind: Kind,
    pub rank: usize,
    pub incarnation: u32,
}

impl RankFile {
    pub fn ready(rank: usize, incarnation: u32) -> RankFile {
        RankFile {
            kind: Kind::Ready,
            rank,
            incarnation,
        }
    }

    pub fn grow(rank: usize, incarnation: u32) -> RankFile {
        RankFile {
            kind: Kind::Grow,
            rank,
            incarnation,
        }
    }

    pub fn report(rank: usize, incarnation: u32) -> RankFile {
        RankFile {
            kind: Kind::Report,
            rank,
            incarnation,
        }
    }

    /// The file's name.
    pub fn name(&self) -> String {
        self.to_string()
    }

    /// The rank file `name` is, if it is one (no bounds checked: see
    /// [`classify`] for a peer's names).
    pub fn parse(name: &str) -> Option<RankFile> {
        let (kind, rest) = split_kind(name)?;
        let (rank, incarnation) = rank_and_incarnation(rest)?;
        Some(RankFile {
            kind,
            rank,
            incarnation,
        })
    }
}

impl fmt::Display for RankFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}-{}-{}",
            self.kind.prefix(),
            self.rank,
            self.incarnation
        )
    }
}

/// `name`'s kind and what follows `KIND-`, when it starts with a rank
/// file's kind.
fn split_kind(name: &str) -> Option<(Kind, &str)> {
    let (prefix, rest) = name.split_once('-')?;
    let kind = Kind::ALL.into_iter().find(|k| k.prefix() == prefix)?;
    Some((kind, rest))
}

/// `RANK-INCARNATION`, each 1 to 10 decimal digits.
fn rank_and_incarnation(s: &str) -> Option<(usize, u32)> {
    let (r, i) = s.split_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.len() <= 10 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(r) || !digits(i) {
        return None;
    }
    Some((r.parse().ok()?, i.parse().ok()?))
}

/// A board file name, as a sidecar relays it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry {
    /// One of a rank's files, of a rank of the job.
    Rank(RankFile),
    /// Any other file a program keeps on the board (e.g. the PyTorch
    /// example's `torch-store-*`, `torch-grow-R-I`): relayed as it is.
    Other,
}

impl Entry {
    pub fn is_report(&self) -> bool {
        matches!(
            self,
            Entry::Rank(RankFile {
                kind: Kind::Report,
                ..
            })
        )
    }
}

/// Checks the safe-name rule: 1 to [`MAX_NAME`] characters of
/// `[A-Za-z0-9._-]`, not starting with a dot (temporary files), not
/// [`DEAD`] (written by the launcher and the sidecars only).
pub fn check_name(name: &str) -> Result<(), BoardError> {
    let safe = |c: u8| c.is_ascii_alphanumeric() || c == b'.' || c == b'_' || c == b'-';
    if name.is_empty()
        || name.len() > MAX_NAME
        || name.starts_with('.')
        || name == DEAD
        || !name.bytes().all(safe)
    {
        return Err(BoardError::UnsafeName(clip(name)));
    }
    Ok(())
}

/// Classifies a name a peer (or this pod's ranks) wrote: a rank file of a
/// rank below `world` and an incarnation up to [`MAX_INCARNATION`], or
/// another safe name.
pub fn classify(name: &str, world: usize) -> Result<Entry, BoardError> {
    check_name(name)?;
    let Some((kind, rest)) = split_kind(name) else {
        return Ok(Entry::Other);
    };
    let (rank, incarnation) =
        rank_and_incarnation(rest).ok_or_else(|| BoardError::MalformedName(clip(name)))?;
    let file = RankFile {
        kind,
        rank,
        incarnation,
    };
    check_rank(rank, incarnation, world)?;
    Ok(Entry::Rank(file))
}

fn check_rank(rank: usize, incarnation: u32, world: usize) -> Result<(), BoardError> {
    if rank >= world {
        return Err(BoardError::RankOutOfRange { rank, world });
    }
    if incarnation > MAX_INCARNATION {
        return Err(BoardError::IncarnationTooLarge(incarnation));
    }
    Ok(())
}

/// Checks a file body's size.
pub fn check_body(name: &str, body: &str) -> Result<(), BoardError> {
    if body.len() > MAX_BODY {
        return Err(BoardError::BodyTooLarge {
            name: clip(name),
            len: body.len(),
        });
    }
    Ok(())
}

/// Checks the number of files and deaths in one post.
pub fn check_post_items(items: usize) -> Result<(), BoardError> {
    if items > MAX_POST_ITEMS {
        return Err(BoardError::TooManyItems(items));
    }
    Ok(())
}

/// Checks that a board of `held` files may take `fresh` new ones.
pub fn check_room(held: usize, fresh: usize) -> Result<(), BoardError> {
    if held.saturating_add(fresh) > MAX_ENTRIES {
        return Err(BoardError::Full);
    }
    Ok(())
}

/// Whether `new` should replace `old` (`None`: no file yet) in a relayed
/// board. A file whose content starts with a sequence number is rewritten
/// with a larger one (a grow file when the survivors abandon a grow and
/// start another); other files never change once written.
pub fn replaces(old: Option<&str>, new: &str) -> bool {
    let seq = |s: &str| {
        s.split_whitespace()
            .next()
            .and_then(|w| w.parse::<u64>().ok())
    };
    match old {
        None => true,
        Some(o) => matches!((seq(o), seq(new)), (Some(a), Some(b)) if b > a),
    }
}

/// A death: incarnation `incarnation` of logical rank `rank` is gone;
/// `replaced`: a replacement is coming (else the budget is spent: `final`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Death {
    pub rank: usize,
    pub incarnation: u32,
    pub replaced: bool,
}

impl Death {
    /// Its line of [`DEAD`], newline included.
    pub fn line(&self) -> String {
        let outcome = if self.replaced { "replaced" } else { "final" };
        format!("{} {} {outcome}\n", self.rank, self.incarnation)
    }

    /// Reads one line of [`DEAD`] (without its newline).
    pub fn parse_line(line: &str) -> Result<Death, BoardError> {
        let bad = || BoardError::MalformedDeath(clip(line));
        let mut w = line.split_whitespace();
        let rank = w.next().and_then(|s| s.parse().ok()).ok_or_else(bad)?;
        let incarnation = w.next().and_then(|s| s.parse().ok()).ok_or_else(bad)?;
        let replaced = match w.next() {
            Some("replaced") => true,
            Some("final") => false,
            _ => return Err(bad()),
        };
        if w.next().is_some() {
            return Err(bad());
        }
        Ok(Death {
            rank,
            incarnation,
            replaced,
        })
    }

    /// Checks a death a peer sent: a rank of the job, a bounded incarnation.
    pub fn check(&self, world: usize) -> Result<(), BoardError> {
        check_rank(self.rank, self.incarnation, world)
    }
}

/// The content of [`DEAD`] for these deaths, in their order.
pub fn dead_file(deaths: impl IntoIterator<Item = Death>) -> String {
    deaths.into_iter().map(|d| d.line()).collect()
}

/// The deaths in a [`DEAD`] file's content. A line that is not one is
/// skipped: a reader acts on the deaths it can read.
pub fn parse_dead(body: &str) -> Vec<Death> {
    body.lines()
        .filter_map(|l| Death::parse_line(l).ok())
        .collect()
}

/// The deaths on the board in `dir` (none when it has no [`DEAD`] yet).
pub fn read_dead(dir: &Path) -> Vec<Death> {
    std::fs::read_to_string(dir.join(DEAD))
        .map(|s| parse_dead(&s))
        .unwrap_or_default()
}

/// Writes `dir/name` whole: a temporary file (a dot name, which no reader
/// takes for a board file, unique in this process), then a rename over
/// `name`. A reader sees the old content or the new, never part of it.
pub fn write_atomic(dir: &Path, name: &str, body: &str) -> std::io::Result<()> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let tmp = dir.join(format!(".{name}.{}.{n}", std::process::id()));
    let written = std::fs::write(&tmp, body).and_then(|_| std::fs::rename(&tmp, dir.join(name)));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

#[cfg(test)]
mod tests;
