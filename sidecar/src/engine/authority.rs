//! A client's `:authority` that hyper's HTTP/2 server refuses, made
//! acceptable before the server sees it (the ranks' Unix socket only).
//!
//! gRPC clients name a Unix socket's path in `:authority`: grpc-core
//! (Python grpcio, C++) sends it percent-encoded (`%2Ftmp%2Fs.sock`),
//! grpc-java as is. hyper's HTTP/2 layer (h2) answers a request whose
//! `:authority` is not a valid URI authority with `RST_STREAM
//! PROTOCOL_ERROR`, so every call failed unless the client set
//! `grpc.default_authority`. The sidecar ignores the authority; this
//! rewriter walks the client's HEADERS (and CONTINUATION) frames, decodes
//! their HPACK block far enough to find `:authority`, and replaces each byte
//! of an invalid value that a host name cannot hold with `-`, keeping its
//! length: the HPACK dynamic tables of the client and of the server then
//! stay the same size, so the indexed references that follow still agree.
//! Other frames pass through as they are. A block it cannot parse, or over
//! [`MAX_BLOCK`], passes through unchanged (the server judges it).

use std::collections::{HashMap, VecDeque};
use std::sync::OnceLock;

/// The largest header block this rewriter buffers (HEADERS and its
/// CONTINUATIONs); beyond, the connection passes through unchanged.
pub const MAX_BLOCK: usize = 64 << 10;
/// Frames it writes are at most this long (every HTTP/2 peer accepts it).
const MAX_FRAME: usize = 16 << 10;
const HEADERS: u8 = 1;
const CONTINUATION: u8 = 9;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
const PREFACE_LEN: usize = 24;

/// The rewriter of one connection's client-to-server bytes.
pub struct Rewriter {
    /// Input not yet handled.
    inp: Vec<u8>,
    /// Output ready for the server.
    pub out: Vec<u8>,
    /// Preface bytes still to pass through.
    preface: usize,
    /// Payload bytes of the current non-header frame still to pass through.
    skip: usize,
    /// HEADERS (+ CONTINUATION) frames of a block being collected, raw.
    block: Vec<u8>,
    /// Gave up (an oversized block): everything passes through.
    off: bool,
    table: Table,
    /// Header blocks rewritten so far.
    pub fixed: u64,
}

impl Default for Rewriter {
    fn default() -> Self {
        Rewriter {
            inp: Vec::new(),
            out: Vec::new(),
            preface: PREFACE_LEN,
            skip: 0,
            block: Vec::new(),
            off: false,
            table: Table::default(),
            fixed: 0,
        }
    }
}

impl Rewriter {
    /// Takes in bytes from the client; what may go to the server is
    /// appended to `out`.
    pub fn feed(&mut self, mut data: &[u8]) {
        if self.preface > 0 {
            let n = self.preface.min(data.len());
            self.out.extend_from_slice(&data[..n]);
            self.preface -= n;
            data = &data[n..];
        }
        if self.off {
            self.out.extend_from_slice(data);
            return;
        }
        if self.skip > 0 && self.inp.is_empty() {
            let n = self.skip.min(data.len());
            self.out.extend_from_slice(&data[..n]);
            self.skip -= n;
            data = &data[n..];
        }
        self.inp.extend_from_slice(data);
        self.step();
    }

    /// The client closed: whatever is held goes on as it is.
    pub fn finish(&mut self) {
        self.out.append(&mut self.block);
        self.out.append(&mut self.inp);
    }

    fn step(&mut self) {
        let mut at = 0;
        loop {
            if self.skip > 0 {
                let n = self.skip.min(self.inp.len() - at);
                self.out.extend_from_slice(&self.inp[at..at + n]);
                self.skip -= n;
                at += n;
                if self.skip > 0 {
                    break;
                }
            }
            let rest = &self.inp[at..];
            if rest.len() < 9 {
                break;
            }
            let len = u32::from_be_bytes([0, rest[0], rest[1], rest[2]]) as usize;
            let (kind, flags) = (rest[3], rest[4]);
            let in_block = !self.block.is_empty();
            if kind != HEADERS && !(in_block && kind == CONTINUATION) {
                if in_block {
                    // Not the CONTINUATION it must be: the server's to judge.
                    self.out.append(&mut self.block);
                }
                self.out.extend_from_slice(&rest[..9]);
                self.skip = len;
                at += 9;
                continue;
            }
            if self.block.len() + 9 + len > MAX_BLOCK + 9 * (MAX_BLOCK / MAX_FRAME + 2) {
                self.out.append(&mut self.block);
                self.out.extend_from_slice(rest);
                at = self.inp.len();
                self.off = true;
                break;
            }
            if rest.len() < 9 + len {
                break; // the rest of the frame is yet to come
            }
            self.block.extend_from_slice(&rest[..9 + len]);
            at += 9 + len;
            if flags & END_HEADERS != 0 {
                let raw = std::mem::take(&mut self.block);
                match self.rewrite(&raw) {
                    Some(frames) => {
                        self.fixed += 1;
                        self.out.extend_from_slice(&frames)
                    }
                    None => self.out.extend_from_slice(&raw),
                }
            }
        }
        self.inp.drain(..at);
        if self.off {
            self.out.append(&mut self.inp);
        }
    }

    /// The frames of a whole header block, rewritten (`None`: nothing to
    /// change, or a block it cannot read; the table is updated either way
    /// as far as it could be read).
    fn rewrite(&mut self, raw: &[u8]) -> Option<Vec<u8>> {
        // Gather the block: HEADERS (less padding and priority) + CONTINUATIONs.
        let (mut block, mut prio, mut flags0, mut stream) = (Vec::new(), None, 0u8, [0u8; 4]);
        let mut at = 0;
        while at + 9 <= raw.len() {
            let len = u32::from_be_bytes([0, raw[at], raw[at + 1], raw[at + 2]]) as usize;
            let (kind, flags) = (raw[at + 3], raw[at + 4]);
            let mut p = &raw[at + 9..at + 9 + len];
            if kind == HEADERS {
                flags0 = flags;
                stream.copy_from_slice(&raw[at + 5..at + 9]);
                let mut pad = 0;
                if flags & PADDED != 0 {
                    pad = *p.first()? as usize;
                    p = &p[1..];
                }
                if flags & PRIORITY != 0 {
                    prio = Some(p.get(..5)?.to_vec());
                    p = &p[5..];
                }
                p = &p[..p.len().checked_sub(pad)?];
            }
            block.extend_from_slice(p);
            at += 9 + len;
        }
        let new = self.table.walk(&block)?;
        // One HEADERS, then CONTINUATIONs, none over MAX_FRAME.
        let mut payload = prio.unwrap_or_default();
        payload.extend_from_slice(&new);
        let mut out = Vec::with_capacity(payload.len() + 64);
        let mut chunks = payload.chunks(MAX_FRAME).peekable();
        let mut first = true;
        while let Some(c) = chunks.next() {
            let last = chunks.peek().is_none();
            let (kind, mut flags) = if first {
                (HEADERS, flags0 & !(PADDED | END_HEADERS))
            } else {
                (CONTINUATION, 0)
            };
            if last {
                flags |= END_HEADERS;
            }
            out.extend_from_slice(&(c.len() as u32).to_be_bytes()[1..]);
            out.extend_from_slice(&[kind, flags]);
            out.extend_from_slice(&stream);
            out.extend_from_slice(c);
            first = false;
        }
        Some(out)
    }
}

/// What this rewriter keeps of the decoder's dynamic table: each entry's
/// name length, whether the name is `:authority`, and its size.
struct Table {
    entries: VecDeque<(usize, bool, usize)>,
    size: usize,
    max: usize,
}

impl Default for Table {
    fn default() -> Self {
        Table {
            entries: VecDeque::new(),
            size: 0,
            max: 4096,
        }
    }
}

/// RFC 7541 Appendix A: the static table's names (index 1..=61).
const STATIC: [&str; 61] = [
    ":authority",
    ":method",
    ":method",
    ":path",
    ":path",
    ":scheme",
    ":scheme",
    ":status",
    ":status",
    ":status",
    ":status",
    ":status",
    ":status",
    ":status",
    "accept-charset",
    "accept-encoding",
    "accept-language",
    "accept-ranges",
    "accept",
    "access-control-allow-origin",
    "age",
    "allow",
    "authorization",
    "cache-control",
    "content-disposition",
    "content-encoding",
    "content-language",
    "content-length",
    "content-location",
    "content-range",
    "content-type",
    "cookie",
    "date",
    "etag",
    "expect",
    "expires",
    "from",
    "host",
    "if-match",
    "if-modified-since",
    "if-none-match",
    "if-range",
    "if-unmodified-since",
    "last-modified",
    "link",
    "location",
    "max-forwards",
    "proxy-authenticate",
    "proxy-authorization",
    "range",
    "referer",
    "refresh",
    "retry-after",
    "server",
    "set-cookie",
    "strict-transport-security",
    "transfer-encoding",
    "user-agent",
    "vary",
    "via",
    "www-authenticate",
];

impl Table {
    fn insert(&mut self, name_len: usize, authority: bool, value_len: usize) {
        let size = name_len + value_len + 32;
        self.entries.push_front((name_len, authority, size));
        self.size += size;
        self.evict();
    }

    fn evict(&mut self) {
        while self.size > self.max {
            match self.entries.pop_back() {
                Some((_, _, s)) => self.size -= s,
                None => break,
            }
        }
    }

    /// The name of entry `i` (1-based, static then dynamic): its length
    /// and whether it is `:authority`.
    fn name(&self, i: usize) -> Option<(usize, bool)> {
        match i {
            0 => None,
            1..=61 => Some((STATIC[i - 1].len(), i == 1)),
            _ => self.entries.get(i - 62).map(|&(n, a, _)| (n, a)),
        }
    }

    /// Walks a header block, updating the table; returns the block with
    /// invalid `:authority` values replaced (`None`: none to replace, or a
    /// block it cannot read).
    fn walk(&mut self, b: &[u8]) -> Option<Vec<u8>> {
        let mut out = Vec::with_capacity(b.len() + 16);
        let mut changed = false;
        let mut at = 0;
        while at < b.len() {
            let start = at;
            let c = b[at];
            if c & 0x80 != 0 {
                // Indexed field: the value is the table's (already fixed).
                int(b, &mut at, 7)?;
                out.extend_from_slice(&b[start..at]);
                continue;
            }
            if c & 0xe0 == 0x20 {
                // Dynamic table size update.
                self.max = int(b, &mut at, 5)?;
                self.evict();
                out.extend_from_slice(&b[start..at]);
                continue;
            }
            // A literal: with incremental indexing (01), without (0000) or
            // never indexed (0001); the name indexed or literal.
            let (prefix, index) = if c & 0xc0 == 0x40 {
                (6, true)
            } else {
                (4, false)
            };
            let i = int(b, &mut at, prefix)?;
            let (name_len, authority) = if i == 0 {
                let name = string(b, &mut at)?;
                (name.len(), name == b":authority")
            } else {
                self.name(i)?
            };
            let name_end = at;
            let value = string(b, &mut at)?;
            if index {
                self.insert(name_len, authority, value.len());
            }
            match authority.then(|| fix(&value)).flatten() {
                Some(v) => {
                    changed = true;
                    out.extend_from_slice(&b[start..name_end]);
                    put_string(&mut out, &v);
                }
                None => out.extend_from_slice(&b[start..at]),
            }
        }
        changed.then_some(out)
    }
}

/// An authority h2 refuses, made acceptable with the same length (`None`:
/// it is fine, or cannot be made so).
fn fix(v: &[u8]) -> Option<Vec<u8>> {
    let ok = |v: &[u8]| axum::http::uri::Authority::try_from(v).is_ok();
    if v.is_empty() || ok(v) {
        return None;
    }
    let f: Vec<u8> = v
        .iter()
        .map(|&c| {
            if c.is_ascii_alphanumeric() || c == b'.' || c == b'-' {
                c
            } else {
                b'-'
            }
        })
        .collect();
    ok(&f).then_some(f)
}

/// Reads an HPACK integer with an `n`-bit prefix (RFC 7541 5.1), at most
/// 2^28 (more is no header this rewriter could hold).
fn int(b: &[u8], at: &mut usize, n: u32) -> Option<usize> {
    let mask = (1usize << n) - 1;
    let mut v = *b.get(*at)? as usize & mask;
    *at += 1;
    if v < mask {
        return Some(v);
    }
    let mut shift = 0;
    loop {
        let c = *b.get(*at)?;
        *at += 1;
        v += ((c & 0x7f) as usize) << shift;
        if c & 0x80 == 0 {
            return (v <= 1 << 28).then_some(v);
        }
        shift += 7;
        if shift > 21 {
            return None;
        }
    }
}

/// Writes an integer with an `n`-bit prefix, `first` holding the bits above it.
fn put_int(out: &mut Vec<u8>, first: u8, n: u32, mut v: usize) {
    let mask = (1usize << n) - 1;
    if v < mask {
        out.push(first | v as u8);
        return;
    }
    out.push(first | mask as u8);
    v -= mask;
    while v >= 0x80 {
        out.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Reads a string literal (raw or Huffman-coded), decoded.
fn string(b: &[u8], at: &mut usize) -> Option<Vec<u8>> {
    let huffman = *b.get(*at)? & 0x80 != 0;
    let len = int(b, at, 7)?;
    let s = b.get(*at..at.checked_add(len)?)?;
    *at += len;
    if huffman {
        huffman_decode(s)
    } else {
        Some(s.to_vec())
    }
}

/// Writes a raw string literal.
fn put_string(out: &mut Vec<u8>, s: &[u8]) {
    put_int(out, 0, 7, s.len());
    out.extend_from_slice(s);
}

/// RFC 7541 Appendix B, symbols 0..=255 (EOS is not needed to decode).
const ENCODE_CODES: [u32; 256] = [
    0x1ff8, 0x7fffd8, 0xfffffe2, 0xfffffe3, 0xfffffe4, 0xfffffe5, 0xfffffe6, 0xfffffe7, 0xfffffe8,
    0xffffea, 0x3ffffffc, 0xfffffe9, 0xfffffea, 0x3ffffffd, 0xfffffeb, 0xfffffec, 0xfffffed,
    0xfffffee, 0xfffffef, 0xffffff0, 0xffffff1, 0xffffff2, 0x3ffffffe, 0xffffff3, 0xffffff4,
    0xffffff5, 0xffffff6, 0xffffff7, 0xffffff8, 0xffffff9, 0xffffffa, 0xffffffb, 0x14, 0x3f8,
    0x3f9, 0xffa, 0x1ff9, 0x15, 0xf8, 0x7fa, 0x3fa, 0x3fb, 0xf9, 0x7fb, 0xfa, 0x16, 0x17, 0x18,
    0x0, 0x1, 0x2, 0x19, 0x1a, 0x1b, 0x1c, 0x1d, 0x1e, 0x1f, 0x5c, 0xfb, 0x7ffc, 0x20, 0xffb,
    0x3fc, 0x1ffa, 0x21, 0x5d, 0x5e, 0x5f, 0x60, 0x61, 0x62, 0x63, 0x64, 0x65, 0x66, 0x67, 0x68,
    0x69, 0x6a, 0x6b, 0x6c, 0x6d, 0x6e, 0x6f, 0x70, 0x71, 0x72, 0xfc, 0x73, 0xfd, 0x1ffb, 0x7fff0,
    0x1ffc, 0x3ffc, 0x22, 0x7ffd, 0x3, 0x23, 0x4, 0x24, 0x5, 0x25, 0x26, 0x27, 0x6, 0x74, 0x75,
    0x28, 0x29, 0x2a, 0x7, 0x2b, 0x76, 0x2c, 0x8, 0x9, 0x2d, 0x77, 0x78, 0x79, 0x7a, 0x7b, 0x7ffe,
    0x7fc, 0x3ffd, 0x1ffd, 0xffffffc, 0xfffe6, 0x3fffd2, 0xfffe7, 0xfffe8, 0x3fffd3, 0x3fffd4,
    0x3fffd5, 0x7fffd9, 0x3fffd6, 0x7fffda, 0x7fffdb, 0x7fffdc, 0x7fffdd, 0x7fffde, 0xffffeb,
    0x7fffdf, 0xffffec, 0xffffed, 0x3fffd7, 0x7fffe0, 0xffffee, 0x7fffe1, 0x7fffe2, 0x7fffe3,
    0x7fffe4, 0x1fffdc, 0x3fffd8, 0x7fffe5, 0x3fffd9, 0x7fffe6, 0x7fffe7, 0xffffef, 0x3fffda,
    0x1fffdd, 0xfffe9, 0x3fffdb, 0x3fffdc, 0x7fffe8, 0x7fffe9, 0x1fffde, 0x7fffea, 0x3fffdd,
    0x3fffde, 0xfffff0, 0x1fffdf, 0x3fffdf, 0x7fffeb, 0x7fffec, 0x1fffe0, 0x1fffe1, 0x3fffe0,
    0x1fffe2, 0x7fffed, 0x3fffe1, 0x7fffee, 0x7fffef, 0xfffea, 0x3fffe2, 0x3fffe3, 0x3fffe4,
    0x7ffff0, 0x3fffe5, 0x3fffe6, 0x7ffff1, 0x3ffffe0, 0x3ffffe1, 0xfffeb, 0x7fff1, 0x3fffe7,
    0x7ffff2, 0x3fffe8, 0x1ffffec, 0x3ffffe2, 0x3ffffe3, 0x3ffffe4, 0x7ffffde, 0x7ffffdf,
    0x3ffffe5, 0xfffff1, 0x1ffffed, 0x7fff2, 0x1fffe3, 0x3ffffe6, 0x7ffffe0, 0x7ffffe1, 0x3ffffe7,
    0x7ffffe2, 0xfffff2, 0x1fffe4, 0x1fffe5, 0x3ffffe8, 0x3ffffe9, 0xffffffd, 0x7ffffe3, 0x7ffffe4,
    0x7ffffe5, 0xfffec, 0xfffff3, 0xfffed, 0x1fffe6, 0x3fffe9, 0x1fffe7, 0x1fffe8, 0x7ffff3,
    0x3fffea, 0x3fffeb, 0x1ffffee, 0x1ffffef, 0xfffff4, 0xfffff5, 0x3ffffea, 0x7ffff4, 0x3ffffeb,
    0x7ffffe6, 0x3ffffec, 0x3ffffed, 0x7ffffe7, 0x7ffffe8, 0x7ffffe9, 0x7ffffea, 0x7ffffeb,
    0xffffffe, 0x7ffffec, 0x7ffffed, 0x7ffffee, 0x7ffffef, 0x7fffff0, 0x3ffffee,
];

const ENCODE_CODE_LENGTHS: [u8; 256] = [
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 30, 28,
    28, 28, 28, 28, 28, 28, 28, 28, 6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6, 5, 5,
    5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12, 10, 13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7,
    7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6, 15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6,
    6, 5, 6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28, 20, 22, 20, 20, 22, 22, 22, 23, 22,
    23, 23, 23, 23, 23, 24, 23, 24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24, 22,
    21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23, 21, 21, 22, 21, 23, 22, 23, 23, 20,
    22, 22, 22, 23, 22, 22, 23, 26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25, 19,
    21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27, 20, 24, 20, 21, 22, 21, 21, 23, 22,
    22, 25, 25, 24, 24, 26, 23, 26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26,
];

/// (code length, code) -> symbol.
fn codes() -> &'static HashMap<(u8, u32), u8> {
    static C: OnceLock<HashMap<(u8, u32), u8>> = OnceLock::new();
    C.get_or_init(|| {
        (0..256)
            .map(|s| ((ENCODE_CODE_LENGTHS[s], ENCODE_CODES[s]), s as u8))
            .collect()
    })
}

/// Decodes a Huffman-coded string (`None`: not valid, RFC 7541 5.2).
fn huffman_decode(s: &[u8]) -> Option<Vec<u8>> {
    let codes = codes();
    let mut out = Vec::with_capacity(s.len() * 8 / 5 + 1);
    let (mut code, mut len) = (0u32, 0u8);
    for &byte in s {
        for bit in (0..8).rev() {
            code = (code << 1) | ((byte >> bit) & 1) as u32;
            len += 1;
            if len >= 5
                && let Some(&sym) = codes.get(&(len, code))
            {
                out.push(sym);
                (code, len) = (0, 0);
            } else if len > 30 {
                return None;
            }
        }
    }
    // Padding: fewer than 8 bits, all ones (the start of EOS).
    (len < 8 && code == (1u32 << len) - 1).then_some(out)
}

#[cfg(test)]
pub(crate) fn huffman_encode(s: &[u8]) -> Vec<u8> {
    let (mut acc, mut bits, mut out) = (0u64, 0u32, Vec::new());
    for &c in s {
        let (code, len) = (
            ENCODE_CODES[c as usize] as u64,
            ENCODE_CODE_LENGTHS[c as usize] as u32,
        );
        acc = (acc << len) | code;
        bits += len;
        while bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    if bits > 0 {
        out.push(((acc << (8 - bits)) | ((1 << (8 - bits)) - 1)) as u8);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        f.extend_from_slice(&[kind, flags]);
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    fn lit(first: u8, value: &[u8], huffman: bool) -> Vec<u8> {
        let mut b = vec![first];
        if huffman {
            let h = huffman_encode(value);
            put_int(&mut b, 0x80, 7, h.len());
            b.extend_from_slice(&h);
        } else {
            put_string(&mut b, value);
        }
        b
    }

    fn run(input: &[u8]) -> (Vec<u8>, u64) {
        let mut r = Rewriter::default();
        r.feed(input);
        r.finish();
        (r.out, r.fixed)
    }

    /// The block's fields, decoded (name, value), with a fresh table.
    fn fields(block: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
        // Enough for these tests: literals with an indexed static name or
        // indexed static/dynamic fields as the tests build them.
        let mut t: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        let mut out = Vec::new();
        let mut at = 0;
        while at < block.len() {
            let c = block[at];
            if c & 0x80 != 0 {
                let i = int(block, &mut at, 7).unwrap();
                out.push(match i {
                    1..=61 => (STATIC[i - 1].as_bytes().to_vec(), Vec::new()),
                    _ => t[i - 62].clone(),
                });
                continue;
            }
            let (p, index) = if c & 0xc0 == 0x40 {
                (6, true)
            } else {
                (4, false)
            };
            let i = int(block, &mut at, p).unwrap();
            let name = if i == 0 {
                string(block, &mut at).unwrap()
            } else {
                STATIC[i - 1].as_bytes().to_vec()
            };
            let v = string(block, &mut at).unwrap();
            if index {
                t.insert(0, (name.clone(), v.clone()));
            }
            out.push((name, v));
        }
        out
    }

    #[test]
    fn huffman_round_trips() {
        for s in [
            &b""[..],
            b"%2Ftmp%2Fs.sock",
            b"localhost",
            &[0u8, 255, 127, 1],
        ] {
            assert_eq!(huffman_decode(&huffman_encode(s)).unwrap(), s);
        }
        // Padding that is not all ones, or 8 bits or more of it, is refused.
        assert!(huffman_decode(&[0x00]).is_none());
        assert!(huffman_decode(&[0xff]).is_none());
    }

    /// grpc-core's authority for a Unix socket (percent-encoded path,
    /// Huffman-coded, indexed) is replaced by a valid one of the same
    /// length; a later request naming it by index passes unchanged, and so
    /// do frames without one. It made every call fail with RST_STREAM
    /// PROTOCOL_ERROR.
    #[test]
    fn a_unix_socket_authority_is_made_valid_keeping_its_length() {
        let bad = b"%2Ftmp%2Fweft%2Fs.sock";
        for huffman in [false, true] {
            let mut b1 = vec![0x83, 0x86];
            b1.extend(lit(0x44, b"/weft.v1.Sidecar/GetStatus", huffman));
            b1.extend(lit(0x41, bad, huffman));
            let settings = frame(4, 0, 0, &[]);
            let h1 = frame(HEADERS, END_HEADERS, 1, &b1);
            let data = frame(0, 1, 1, &[0, 0, 0, 0, 0]);
            // The second request names both by index (62: :authority, 63: :path).
            let h2 = frame(HEADERS, END_HEADERS, 3, &[0x83, 0x86, 0xbf, 0xbe]);
            let input = [PREFACE, &settings, &h1, &data, &h2].concat();
            let (out, fixed) = run(&input);
            assert_eq!(fixed, 1);
            let want_h1 = {
                let mut b = vec![0x83, 0x86];
                b.extend(lit(0x44, b"/weft.v1.Sidecar/GetStatus", huffman));
                b.extend(lit(0x41, b"-2Ftmp-2Fweft-2Fs.sock", false));
                frame(HEADERS, END_HEADERS, 1, &b)
            };
            assert_eq!(out, [PREFACE, &settings, &want_h1, &data, &h2].concat());
            let f = fields(&want_h1[9..]);
            assert_eq!(f[3].1.len(), bad.len());
            assert!(axum::http::uri::Authority::try_from(&f[3].1[..]).is_ok());
        }
    }

    /// Padding and priority are dropped or kept as they must be, and a
    /// block split over CONTINUATION frames is read whole; a valid
    /// authority (or none) changes nothing.
    #[test]
    fn padded_prioritized_and_continued_blocks() {
        let mut b = vec![0x83];
        b.extend(lit(0x01, b"/a b", false)); // without indexing, static name
        let mut p = vec![3u8]; // pad length
        p.extend_from_slice(&[0, 0, 0, 0, 16]); // priority
        p.extend_from_slice(&b[..2]);
        p.extend_from_slice(&[0, 0, 0]);
        let h = frame(HEADERS, PADDED | PRIORITY | 1, 5, &p);
        let c = frame(CONTINUATION, END_HEADERS, 5, &b[2..]);
        let (out, fixed) = run(&[PREFACE, &h, &c].concat());
        assert_eq!(fixed, 1);
        let mut want = vec![0, 0, 0, 0, 16, 0x83];
        want.extend(lit(0x01, b"-a-b", false));
        assert_eq!(
            out,
            [
                PREFACE,
                &frame(HEADERS, PRIORITY | 1 | END_HEADERS, 5, &want)
            ]
            .concat()
        );
        let mut ok = vec![0x83];
        ok.extend(lit(0x41, b"localhost:50051", true));
        let input = [PREFACE, &frame(HEADERS, END_HEADERS, 1, &ok)].concat();
        assert_eq!(run(&input), (input.clone(), 0));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        /// Any bytes, in any chunks: no panic, output bounded by the input,
        /// and unchanged unless a block was rewritten.
        #[test]
        fn arbitrary_bytes_pass_through(
            body in proptest::collection::vec(any::<u8>(), 0..4096),
            cuts in proptest::collection::vec(0usize..4096, 0..8),
        ) {
            let input = [PREFACE, &body].concat();
            let mut r = Rewriter::default();
            let mut cuts = cuts;
            cuts.push(input.len());
            cuts.sort();
            let mut at = 0;
            for c in cuts {
                let c = c.min(input.len());
                r.feed(&input[at..c.max(at)]);
                at = at.max(c);
                prop_assert!(r.inp.len() + r.block.len() <= MAX_BLOCK + 64 * 9 + input.len().min(MAX_BLOCK));
            }
            r.finish();
            if r.fixed == 0 {
                prop_assert_eq!(&r.out, &input);
            }
            prop_assert!(r.out.len() <= input.len() * 2 + 64);
        }

        /// Well-formed header frames with random fields, mutated: never a
        /// panic; unmutated, the rewrite is stable in any chunking.
        #[test]
        fn header_frames_in_any_chunks(
            values in proptest::collection::vec((0u8..4, proptest::collection::vec(any::<u8>(), 0..40), any::<bool>()), 1..12),
            flip in proptest::option::of((any::<usize>(), any::<u8>())),
            step in 1usize..64,
        ) {
            let mut block = Vec::new();
            for (kind, v, h) in &values {
                let first = match kind { 0 => 0x41, 1 => 0x01, 2 => 0x44, _ => 0x10 | 1 };
                block.extend(lit(first, v, *h));
            }
            let mut input = [PREFACE, &frame(HEADERS, END_HEADERS, 1, &block)].concat();
            if let Some((i, x)) = flip {
                let i = PREFACE.len() + i % (input.len() - PREFACE.len());
                input[i] ^= x;
            }
            let (whole, _) = run(&input);
            let mut r = Rewriter::default();
            for c in input.chunks(step) {
                r.feed(c);
            }
            r.finish();
            prop_assert_eq!(r.out, whole);
        }
    }
}
