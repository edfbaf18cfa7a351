//! Message sizes: parsing `8`, `64K`, `1M`, `2G` (binary units, as nccl-tests)
//! and the sweep from `-b` to `-e` by `-f`.

/// Parses a byte count with an optional `K`, `M` or `G` suffix (powers of 1024;
/// a trailing `B`/`iB` is accepted too: `4KiB`, `4KB`).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    let body = lower
        .strip_suffix("ib")
        .or_else(|| lower.strip_suffix('b'))
        .unwrap_or(&lower);
    let (digits, shift) = match body.chars().last() {
        Some('k') => (&body[..body.len() - 1], 10),
        Some('m') => (&body[..body.len() - 1], 20),
        Some('g') => (&body[..body.len() - 1], 30),
        _ => (body, 0),
    };
    let n: u64 = digits
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a size (e.g. 8, 64K, 1M, 2G)"))?;
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("'{s}' is too large"))
}

/// The sizes of a sweep: `min`, `min*factor`, ... while `<= max` (nccl-tests' loop).
/// A factor of 1 would never end; it is treated as 2 by the caller's validation.
pub fn sweep(min: u64, max: u64, factor: u64) -> Vec<u64> {
    let mut out = Vec::new();
    let factor = factor.max(2);
    let mut s = min;
    while s <= max {
        out.push(s);
        if s == 0 {
            // 0 * factor stays 0: go on with the next power of the factor.
            s = 1;
            continue;
        }
        match s.checked_mul(factor) {
            Some(n) => s = n,
            None => break,
        }
    }
    out
}

/// Human form for headers and docs: `8 B`, `64 KiB`, `1 MiB`, `3000 B`.
pub fn human(bytes: u64) -> String {
    for (shift, unit) in [(30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{} {unit}", bytes >> shift);
        }
    }
    format!("{bytes} B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_suffixes() {
        assert_eq!(parse_size("8").unwrap(), 8);
        assert_eq!(parse_size("64K").unwrap(), 65536);
        assert_eq!(parse_size("64k").unwrap(), 65536);
        assert_eq!(parse_size("1M").unwrap(), 1 << 20);
        assert_eq!(parse_size("256M").unwrap(), 256 << 20);
        assert_eq!(parse_size("2G").unwrap(), 2 << 30);
        assert_eq!(parse_size("4KiB").unwrap(), 4096);
        assert_eq!(parse_size("4KB").unwrap(), 4096);
        assert_eq!(parse_size("100B").unwrap(), 100);
        assert!(parse_size("x").is_err());
        assert!(parse_size("1T").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999G").is_err());
    }

    #[test]
    fn sweeps_like_nccl_tests() {
        assert_eq!(sweep(8, 64, 2), vec![8, 16, 32, 64]);
        assert_eq!(sweep(8, 100, 2), vec![8, 16, 32, 64]);
        assert_eq!(sweep(8, 64 << 10, 8), vec![8, 64, 512, 4096, 32768]);
        assert_eq!(sweep(1 << 20, 1 << 20, 2), vec![1 << 20]);
        assert_eq!(sweep(64, 8, 2), Vec::<u64>::new());
        assert_eq!(sweep(8, 256 << 20, 2).len(), 26);
        assert_eq!(sweep(0, 4, 2), vec![0, 1, 2, 4]);
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human(8), "8 B");
        assert_eq!(human(65536), "64 KiB");
        assert_eq!(human(256 << 20), "256 MiB");
        assert_eq!(human(3000), "3000 B");
        assert_eq!(human(1 << 30), "1 GiB");
    }
}
