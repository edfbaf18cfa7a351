//! Parsers of command-line values that several subcommands share (a leaf:
//! `weft run`, `weft bench` and `weft ras` each name it from their
//! argument structs).

use std::time::Duration;

/// Seconds as an integer or decimal, e.g. `3` or `0.5` (every command's
/// `--timeout`).
pub fn parse_secs(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .parse()
        .map_err(|_| format!("'{s}' is not a number of seconds"))?;
    Duration::try_from_secs_f64(secs).map_err(|_| format!("'{s}' is not a valid duration"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_whole_and_decimal() {
        assert_eq!(parse_secs("3"), Ok(Duration::from_secs(3)));
        assert_eq!(parse_secs("0.5"), Ok(Duration::from_millis(500)));
        for bad in ["", "x", "-1", "1e400", "NaN"] {
            assert!(parse_secs(bad).is_err(), "{bad:?}");
        }
    }
}
