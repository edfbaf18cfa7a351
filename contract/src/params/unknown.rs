//! A warning for `WEFT_*` variables nobody reads (usually a misspelling),
//! naming the closest declared one.

use super::PARAMS;
use std::sync::Once;

/// An undeclared `WEFT_*` variable and the closest declared name, if any is close.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unknown {
    pub name: String,
    pub suggestion: Option<&'static str>,
}

impl std::fmt::Display for Unknown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.suggestion {
            Some(s) => write!(f, "weft: unknown variable {}; did you mean {s}?", self.name),
            None => write!(
                f,
                "weft: unknown variable {} (README.md lists the variables Weft reads)",
                self.name
            ),
        }
    }
}

/// Levenshtein distance (insertions, deletions, substitutions), by bytes.
pub fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut cur = vec![0; b.len() + 1];
    for (i, &x) in a.iter().enumerate() {
        cur[0] = i + 1;
        for (j, &y) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(x != y);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()]
}

/// The declared name closest to `name` (ignoring case), when it is close: at
/// most 3 edits, and fewer than a third of the name's length.
pub fn suggest(name: &str) -> Option<&'static str> {
    let upper = name.to_ascii_uppercase();
    let limit = 3.min(upper.len().div_ceil(3));
    PARAMS
        .iter()
        .map(|p| (edit_distance(&upper, p.name), p.name))
        .filter(|&(d, _)| d <= limit)
        .min_by_key(|&(d, _)| d)
        .map(|(_, n)| n)
}

/// The `WEFT_*` names among `names` that are not declared, in the given order.
pub fn unknown_vars<I, S>(names: I) -> Vec<Unknown>
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    names
        .into_iter()
        .filter_map(|n| {
            let n = n.as_ref();
            (n.starts_with("WEFT_") && !PARAMS.iter().any(|p| p.name == n)).then(|| Unknown {
                name: n.to_string(),
                suggestion: suggest(n),
            })
        })
        .collect()
}

/// Warns on stderr about every undeclared `WEFT_*` variable in the process
/// environment, once per process (later calls do nothing). The `weft` command
/// calls it at start, libcomm when it initialises.
pub fn warn_unknown_once() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let mut names: Vec<String> = std::env::vars_os()
            .filter_map(|(k, _)| k.into_string().ok())
            .collect();
        names.sort();
        for u in unknown_vars(names) {
            eprintln!("{u}");
        }
    });
}
