//! Moving ranks' output to ours: one thread polls every rank's stdout and
//! stderr pipe and writes whole lines prefixed with the rank (`[3] ...`),
//! several to a `write(2)` of at most [`BATCH`] bytes (a longer line alone):
//! a write that size is never split by another writer (the launcher's own
//! messages, `diag`), so lines never interleave mid-line, and a rank that
//! prints 1,000 lines at once costs a few dozen system calls, not 1,000
//! (each competing for a CPU with the ranks: a benchmark that printed its
//! per-call table slowed its own next calls). Bytes are passed through
//! untouched (invalid UTF-8 included).
//!
//! Two exceptions to "whole lines": a line longer than [`MAX_LINE`] is written
//! in pieces (bounded memory), and a final line without a newline is written
//! at end of stream with a newline added, so the next prefix starts a line.
//!
//! In capture mode nothing is printed: each rank's raw bytes are collected.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Longest piece buffered while waiting for a newline.
pub const MAX_LINE: usize = 64 * 1024;

/// Whole lines are gathered into writes of up to this many bytes: POSIX's
/// PIPE_BUF, the size a pipe never splits between writers.
pub const BATCH: usize = 4096;

/// How long to keep draining pipes after every rank has ended. Only a process
/// that escaped its rank's process group can hold a pipe open that long.
const DRAIN: Duration = Duration::from_secs(1);

/// What one rank wrote, when captured.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RankOutput {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

/// Where output goes.
#[derive(Debug, Clone, Copy)]
pub enum Sink {
    /// To our stdout/stderr, with `[rank] ` prefixes when `prefix`.
    Print { prefix: bool },
    /// Into [`RankOutput`] buffers.
    Capture,
}

struct Stream {
    fd: OwnedFd,
    rank: usize,
    is_stderr: bool,
    pending: Vec<u8>,
    /// A piece of an over-long line was written: the rest gets no new prefix.
    mid_line: bool,
    open: bool,
}

impl Stream {
    /// The two streams of one rank: its stdout and stderr pipes, both open.
    fn of_rank(rank: usize, stdout: OwnedFd, stderr: OwnedFd) -> [Stream; 2] {
        [(stdout, false), (stderr, true)].map(|(fd, is_stderr)| Stream {
            fd,
            rank,
            is_stderr,
            pending: Vec::new(),
            mid_line: false,
            open: true,
        })
    }
}

/// Pipes of ranks started later (a replaced rank): (rank, stdout, stderr),
/// picked up by the output thread.
type Added = std::sync::Mutex<Vec<(usize, OwnedFd, OwnedFd)>>;

/// The running output thread.
pub struct Pump {
    done: Arc<AtomicBool>,
    handle: JoinHandle<Vec<RankOutput>>,
    added: Arc<Added>,
}

impl Pump {
    /// Starts pumping `pipes[rank] = (stdout, stderr)`.
    pub fn start(pipes: Vec<(OwnedFd, OwnedFd)>, sink: Sink) -> Pump {
        let ranks = pipes.len();
        let mut streams = Vec::with_capacity(2 * ranks);
        for (rank, (out, err)) in pipes.into_iter().enumerate() {
            streams.extend(Stream::of_rank(rank, out, err));
        }
        let done = Arc::new(AtomicBool::new(false));
        let flag = done.clone();
        let added: Arc<Added> = Default::default();
        let incoming = added.clone();
        let handle = std::thread::Builder::new()
            .name("weft-output".into())
            .spawn(move || {
                let mut w = Writer::new(sink, ranks, [1, 2]);
                pump(&mut streams, &mut w, &flag, &incoming);
                w.out
            })
            .expect("spawn output thread");
        Pump {
            done,
            handle,
            added,
        }
    }

    /// Pumps the pipes of a rank started again (its output goes on under
    /// the same rank).
    pub fn add(&self, rank: usize, stdout: OwnedFd, stderr: OwnedFd) {
        self.added
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((rank, stdout, stderr));
    }

    /// Call once every rank has ended: drains what is left (bounded by
    /// [`DRAIN`]) and returns the captured output (empty buffers when printing).
    pub fn finish(self) -> Vec<RankOutput> {
        self.done.store(true, Ordering::SeqCst);
        self.handle.join().unwrap_or_default()
    }
}

fn digits(mut n: usize) -> usize {
    let mut d = 1;
    while n >= 10 {
        n /= 10;
        d += 1;
    }
    d
}

fn pump(streams: &mut Vec<Stream>, w: &mut Writer, done: &AtomicBool, added: &Added) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut deadline: Option<Instant> = None;
    loop {
        for (rank, out, err) in added.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
            streams.extend(Stream::of_rank(rank, out, err));
        }
        let open: Vec<usize> = (0..streams.len()).filter(|&i| streams[i].open).collect();
        if open.is_empty() {
            // A replaced rank's pipes may still come while the job runs.
            if done.load(Ordering::SeqCst) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        if done.load(Ordering::SeqCst) {
            let d = *deadline.get_or_insert_with(|| Instant::now() + DRAIN);
            if Instant::now() >= d {
                for s in streams.iter_mut().filter(|s| s.open) {
                    close(s, w);
                }
                return;
            }
        }
        let mut fds: Vec<libc::pollfd> = open
            .iter()
            .map(|&i| libc::pollfd {
                fd: streams[i].fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        // SAFETY: fds is a valid array of pollfd of the given length.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 50) };
        if n <= 0 {
            continue; // timeout or EINTR: re-check the done flag
        }
        for (pfd, &i) in fds.iter().zip(&open) {
            if pfd.revents == 0 {
                continue;
            }
            let s = &mut streams[i];
            // SAFETY: reading into our own buffer from an fd we own.
            let got = unsafe { libc::read(s.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if got > 0 {
                s.pending.extend_from_slice(&buf[..got as usize]);
                emit_lines(s, w);
            } else if got == 0
                || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted
            {
                close(s, w);
            }
        }
    }
}

/// Writes every complete line in `s.pending`, and a piece of an over-long line.
fn emit_lines(s: &mut Stream, w: &mut Writer) {
    let whole = s
        .pending
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |nl| nl + 1);
    if whole > 0 {
        w.lines(s.rank, s.is_stderr, &s.pending[..whole], !s.mid_line);
        s.mid_line = false;
    }
    s.pending.drain(..whole);
    if s.pending.len() >= MAX_LINE {
        w.write(s.rank, s.is_stderr, &s.pending, !s.mid_line, false);
        s.pending.clear();
        s.mid_line = true;
    }
}

/// End of stream: flush a partial last line (adding the newline) and close.
fn close(s: &mut Stream, w: &mut Writer) {
    if !s.pending.is_empty() {
        w.write(s.rank, s.is_stderr, &s.pending, !s.mid_line, true);
        s.pending.clear();
    }
    s.open = false;
}

struct Writer {
    sink: Sink,
    width: usize,
    out: Vec<RankOutput>,
    /// Where printed output goes: our stdout and stderr (a pipe in tests).
    fds: [RawFd; 2],
    /// Our stdout/stderr went away (EPIPE...): keep draining, stop writing.
    broken: [bool; 2],
    /// `write_all` calls made (each one `write(2)` but for short writes):
    /// what the tests count to see lines gathered.
    writes: usize,
}

impl Writer {
    fn new(sink: Sink, ranks: usize, fds: [RawFd; 2]) -> Writer {
        Writer {
            sink,
            width: digits(ranks.saturating_sub(1)),
            out: vec![RankOutput::default(); ranks],
            fds,
            broken: [false; 2],
            writes: 0,
        }
    }

    /// Whole lines of one rank's stream (`bytes` ends with a newline), each
    /// prefixed but the first when it continues a piece already written
    /// (`first_prefixed` false), gathered into writes of at most [`BATCH`].
    fn lines(&mut self, rank: usize, is_stderr: bool, bytes: &[u8], first_prefixed: bool) {
        let Sink::Print { prefix: want } = self.sink else {
            return self.write(rank, is_stderr, bytes, false, false);
        };
        let idx = usize::from(is_stderr);
        let tag = self.tag(rank);
        let mut batch = Vec::with_capacity(BATCH);
        for (i, line) in bytes.split_inclusive(|&b| b == b'\n').enumerate() {
            let tagged = want && (i > 0 || first_prefixed);
            let len = line.len() + if tagged { tag.len() } else { 0 };
            if !batch.is_empty() && batch.len() + len > BATCH {
                self.flush(idx, &batch);
                batch.clear();
            }
            if tagged {
                batch.extend_from_slice(tag.as_bytes());
            }
            batch.extend_from_slice(line);
        }
        if !batch.is_empty() {
            self.flush(idx, &batch);
        }
    }

    /// The prefix of rank `rank`'s lines, padded to the widest rank.
    fn tag(&self, rank: usize) -> String {
        format!("[{rank:>w$}] ", w = self.width)
    }

    fn flush(&mut self, idx: usize, bytes: &[u8]) {
        if self.broken[idx] {
            return;
        }
        self.writes += 1;
        if write_all(self.fds[idx], bytes).is_err() {
            self.broken[idx] = true;
        }
    }

    fn write(&mut self, rank: usize, is_stderr: bool, bytes: &[u8], prefix: bool, add_nl: bool) {
        match self.sink {
            Sink::Capture => {
                let o = &mut self.out[rank];
                let buf = if is_stderr {
                    &mut o.stderr
                } else {
                    &mut o.stdout
                };
                buf.extend_from_slice(bytes);
            }
            Sink::Print { prefix: want } => {
                let idx = usize::from(is_stderr);
                let mut line = Vec::with_capacity(bytes.len() + self.width + 4);
                if want && prefix {
                    line.extend_from_slice(self.tag(rank).as_bytes());
                }
                line.extend_from_slice(bytes);
                if add_nl {
                    line.push(b'\n');
                }
                self.flush(idx, &line);
            }
        }
    }
}

/// One `write(2)` per call in the normal case; loops only on a short write
/// (huge line into a full pipe) or EINTR, and waits out EAGAIN when our
/// inherited stdout happens to be non-blocking.
pub fn write_all(fd: RawFd, mut bytes: &[u8]) -> std::io::Result<()> {
    while !bytes.is_empty() {
        // SAFETY: writing from a valid slice.
        let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
        if n >= 0 {
            bytes = &bytes[n as usize..];
            continue;
        }
        let err = std::io::Error::last_os_error();
        match err.kind() {
            std::io::ErrorKind::Interrupted => {}
            std::io::ErrorKind::WouldBlock => {
                let mut p = libc::pollfd {
                    fd,
                    events: libc::POLLOUT,
                    revents: 0,
                };
                // SAFETY: one valid pollfd.
                unsafe { libc::poll(&mut p, 1, 100) };
            }
            _ => return Err(err),
        }
    }
    Ok(())
}

/// Writes `"<label>: <msg>\n"` to stderr in one write, so it never splits a rank's line.
pub(crate) fn diag(label: &str, msg: &str) {
    let _ = write_all(2, format!("{label}: {msg}\n").as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pipe as the writer's stdout: its read end and the writer.
    fn piped(ranks: usize, prefix: bool) -> (std::fs::File, Writer) {
        let mut fds = [0; 2];
        // SAFETY: a valid array of two fds to fill.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both fds were just opened and are owned here.
        let read = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fds[0]) };
        (
            read,
            Writer::new(Sink::Print { prefix }, ranks, [fds[1], 2]),
        )
    }

    fn stream(rank: usize, text: &[u8]) -> Stream {
        let [s, _] = Stream::of_rank(
            rank,
            std::fs::File::open("/dev/null").unwrap().into(),
            std::fs::File::open("/dev/null").unwrap().into(),
        );
        Stream {
            pending: text.to_vec(),
            ..s
        }
    }

    /// Everything written, once the write end is closed.
    fn drained(mut read: std::fs::File, w: Writer) -> Vec<u8> {
        // SAFETY: the write end is ours and closed once.
        unsafe { libc::close(w.fds[0]) };
        let mut got = Vec::new();
        std::io::Read::read_to_end(&mut read, &mut got).unwrap();
        got
    }

    /// 1,000 short lines read at once go out in writes of at most BATCH
    /// bytes, each prefixed, none split, the partial last line kept.
    #[test]
    fn many_lines_go_out_in_few_writes_of_whole_lines() {
        let (read, mut w) = piped(12, true);
        let mut text: Vec<u8> = (0..1000)
            .flat_map(|i| format!("cell {i} p50 12.5 p99 20.1\n").into_bytes())
            .collect();
        text.extend_from_slice(b"partial");
        let mut s = stream(7, &text);
        // Drain concurrently: 1,000 lines are more than a pipe holds.
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            let mut read = read;
            std::io::Read::read_to_end(&mut read, &mut got).unwrap();
            got
        });
        emit_lines(&mut s, &mut w);
        assert_eq!(s.pending, b"partial", "the partial line waits");
        let writes = w.writes;
        // SAFETY: the write end is ours and closed once.
        unsafe { libc::close(w.fds[0]) };
        let got = String::from_utf8(reader.join().unwrap()).unwrap();
        let lines: Vec<&str> = got.lines().collect();
        assert_eq!(lines.len(), 1000);
        for (i, l) in lines.iter().enumerate() {
            assert_eq!(*l, format!("[ 7] cell {i} p50 12.5 p99 20.1"));
        }
        let bytes = got.len();
        assert!(
            writes <= bytes / (BATCH - 40) + 1 && writes >= bytes.div_ceil(BATCH),
            "{writes} writes for {bytes} bytes"
        );
    }

    /// A line longer than BATCH goes alone in one write; a piece that
    /// continues an over-long line is not prefixed again.
    #[test]
    fn a_long_line_goes_alone_and_a_continued_line_keeps_no_prefix() {
        let (read, mut w) = piped(2, true);
        let long = vec![b'x'; BATCH + 10];
        let mut text = b"rest of a long line\nshort\n".to_vec();
        text.extend_from_slice(&long);
        text.push(b'\n');
        text.extend_from_slice(b"after\n");
        let mut s = stream(1, &text);
        s.mid_line = true;
        emit_lines(&mut s, &mut w);
        assert_eq!(w.writes, 3, "short lines, the long one, the line after it");
        let got = drained(read, w);
        let mut want = b"rest of a long line\n[1] short\n[1] ".to_vec();
        want.extend_from_slice(&long);
        want.extend_from_slice(b"\n[1] after\n");
        assert!(got == want, "{:?}", String::from_utf8_lossy(&got[..60]));
    }

    /// Without prefixes the bytes pass through unchanged, batched alike.
    #[test]
    fn without_prefixes_lines_pass_through() {
        let (read, mut w) = piped(2, false);
        let mut s = stream(0, b"a\nb\n\xff\xfe\n");
        emit_lines(&mut s, &mut w);
        assert_eq!(w.writes, 1);
        assert_eq!(drained(read, w), b"a\nb\n\xff\xfe\n");
    }

    #[test]
    fn prefix_width() {
        assert_eq!(digits(0), 1);
        assert_eq!(digits(9), 1);
        assert_eq!(digits(10), 2);
        assert_eq!(digits(127), 3);
    }
}
