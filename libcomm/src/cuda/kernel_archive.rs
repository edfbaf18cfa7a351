//! The container the build packs one architecture's compiled kernels into
//! (`libcomm/build.rs` writes it, the loader reads it from the library):
//! named entries, each compressed on its own (zlib: deflate plus a
//! checksum), so that a process inflates only the kernels it uses. Shared with the build script (no
//! crate imports besides `miniz_oxide`).
//!
//! Layout (little-endian): the magic `WEFTKAR1`, an entry count (u32), then
//! per entry: name length (u16), name (UTF-8), uncompressed length (u32),
//! compressed length (u32), compressed bytes.

use std::fmt;

const MAGIC: &[u8; 8] = b"WEFTKAR1";

/// Compression level of the build (9: smallest; the build compresses once).
#[cfg_attr(not(test), allow(dead_code))] // packing is the build script's
const LEVEL: u8 = 9;

/// An archive that does not parse, or an entry that does not inflate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArchiveError(pub String);

impl fmt::Display for ArchiveError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "kernel archive: {}", self.0)
    }
}

/// Packs `(name, bytes)` entries, in order.
#[cfg_attr(not(test), allow(dead_code))] // packing is the build script's
pub fn pack(entries: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    for (name, bytes) in entries {
        let packed = miniz_oxide::deflate::compress_to_vec_zlib(bytes, LEVEL);
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        out.extend_from_slice(&(packed.len() as u32).to_le_bytes());
        out.extend_from_slice(&packed);
    }
    out
}

/// One entry of a parsed archive (still compressed).
#[derive(Clone, Copy, Debug)]
pub struct Entry<'a> {
    pub name: &'a str,
    raw_len: usize,
    packed: &'a [u8],
}

impl Entry<'_> {
    /// The entry's bytes, inflated.
    pub fn bytes(&self) -> Result<Vec<u8>, ArchiveError> {
        let v = miniz_oxide::inflate::decompress_to_vec_zlib_with_limit(self.packed, self.raw_len)
            .map_err(|e| ArchiveError(format!("{}: does not inflate ({e:?})", self.name)))?;
        if v.len() != self.raw_len {
            return Err(ArchiveError(format!(
                "{}: {} bytes, {} expected",
                self.name,
                v.len(),
                self.raw_len
            )));
        }
        Ok(v)
    }
}

/// Reads an archive's directory (nothing is inflated).
pub fn parse(data: &[u8]) -> Result<Vec<Entry<'_>>, ArchiveError> {
    let mut r = Reader { data, at: 0 };
    if r.take(MAGIC.len())? != MAGIC {
        return Err(ArchiveError("bad magic".into()));
    }
    let count = r.u32()? as usize;
    let mut entries = Vec::with_capacity(count.min(1024));
    for _ in 0..count {
        let name_len = r.u16()? as usize;
        let name = std::str::from_utf8(r.take(name_len)?)
            .map_err(|_| ArchiveError("a name is not UTF-8".into()))?;
        let raw_len = r.u32()? as usize;
        let packed_len = r.u32()? as usize;
        let packed = r.take(packed_len)?;
        entries.push(Entry {
            name,
            raw_len,
            packed,
        });
    }
    if r.at != data.len() {
        return Err(ArchiveError(format!(
            "{} bytes after the last entry",
            data.len() - r.at
        )));
    }
    Ok(entries)
}

struct Reader<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ArchiveError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.data.len())
            .ok_or_else(|| ArchiveError(format!("truncated at byte {}", self.at)))?;
        let s = &self.data[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u16(&mut self) -> Result<u16, ArchiveError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, ArchiveError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<(String, Vec<u8>)> {
        vec![
            (
                "weft_p2p".into(),
                (0..5000u32).map(|i| (i % 7) as u8).collect(),
            ),
            ("empty".into(), Vec::new()),
            ("weft_move_4".into(), b"\x7fELF and more".to_vec()),
        ]
    }

    #[test]
    fn entries_round_trip_in_order() {
        let packed = pack(&sample());
        let got = parse(&packed).unwrap();
        assert_eq!(got.len(), 3);
        for (e, (name, bytes)) in got.iter().zip(sample()) {
            assert_eq!(e.name, name);
            assert_eq!(e.bytes().unwrap(), bytes);
        }
        // Compressed: the repetitive entry shrinks.
        assert!(packed.len() < 1000, "{}", packed.len());
    }

    #[test]
    fn damaged_archives_are_errors_not_panics() {
        let packed = pack(&sample());
        assert!(parse(b"WEFTKAR0\0\0\0\0").is_err());
        for cut in [0, 7, 12, 20, packed.len() - 1] {
            assert!(parse(&packed[..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = packed.clone();
        longer.push(0);
        assert!(parse(&longer).is_err());
        // A corrupted payload parses but fails its checksum.
        let mut bad = packed.clone();
        let at = 8 + 4 + 2 + "weft_p2p".len() + 8 + 3;
        bad[at] ^= 0xff;
        let entries = parse(&bad).unwrap();
        assert!(entries[0].bytes().is_err());
    }
}
