//! Reading the module paths a Rust source file names, without a parser
//! crate: a small lexer (comments, strings and character literals dropped,
//! so a path in a doc comment or a message is not an import), then every
//! path that starts at `crate`, `$crate`, `self`, `super` or a module the
//! file declares, with `use` trees (`a::{b::C, d::{self, E}}`) expanded
//! into one path per leaf. Inline modules (`mod tests { use super::*; }`)
//! are tracked, so `super` inside one means the file's own module.

/// One token: an identifier, `::`, or any other single character.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tok {
    Ident(String),
    PathSep,
    Punct(char),
}

#[derive(Debug, Clone)]
pub struct Token {
    pub tok: Tok,
    pub line: usize,
}

fn is_ident_start(c: char) -> bool {
    c.is_alphabetic() || c == '_'
}

fn is_ident_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The tokens of `src` that can take part in a path.
pub fn lex(src: &str) -> Vec<Token> {
    let s: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    // Skips to just after the closing `"` of a string whose body starts at
    // `j`, ended by `"` and `hashes` `#`s (escapes only when not raw).
    let skip_string = |mut j: usize, raw: bool, hashes: usize, line: &mut usize| -> usize {
        while j < s.len() {
            match s[j] {
                '\\' if !raw => j += 1,
                '\n' => *line += 1,
                '"' if s
                    .get(j + 1..j + 1 + hashes)
                    .is_some_and(|t| t.iter().all(|&c| c == '#')) =>
                {
                    return j + 1 + hashes;
                }
                _ => {}
            }
            j += 1;
        }
        j
    };
    while i < s.len() {
        let c = s[i];
        let next = s.get(i + 1).copied();
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == '/' && next == Some('/') {
            while i < s.len() && s[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < s.len() {
                if s[i] == '/' && s.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if s[i] == '*' && s.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if s[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
            }
        } else if c == '"' {
            i = skip_string(i + 1, false, 0, &mut line);
        } else if c == '\'' {
            // A character literal ('x', '\n', '\u{..}') or a lifetime ('a).
            if next == Some('\\') {
                let mut j = i + 3;
                while j < s.len() && s[j] != '\'' {
                    j += 1;
                }
                i = j + 1;
            } else if s.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                i += 1;
            }
        } else if c == '$' && next.is_some_and(is_ident_start) {
            let start = i;
            i += 1;
            while i < s.len() && is_ident_char(s[i]) {
                i += 1;
            }
            let word: String = s[start..i].iter().collect();
            out.push(Token {
                tok: Tok::Ident(word),
                line,
            });
        } else if is_ident_start(c) {
            let start = i;
            while i < s.len() && is_ident_char(s[i]) {
                i += 1;
            }
            let word: String = s[start..i].iter().collect();
            // Raw and byte strings: r"..", r#".."#, b"..", br#".."#.
            let hashes = s[i..].iter().take_while(|&&c| c == '#').count();
            let raw = matches!(word.as_str(), "r" | "br");
            if (raw || word == "b") && s.get(i + hashes) == Some(&'"') && (raw || hashes == 0) {
                i = skip_string(i + hashes + 1, raw, hashes, &mut line);
                continue;
            }
            // A raw identifier: r#type.
            if word == "r" && hashes == 1 && s.get(i + 1).copied().is_some_and(is_ident_start) {
                continue;
            }
            if word == "b" && s.get(i) == Some(&'\'') {
                continue; // b'x': the literal is skipped next
            }
            out.push(Token {
                tok: Tok::Ident(word),
                line,
            });
        } else if c.is_ascii_digit() {
            while i < s.len()
                && (is_ident_char(s[i])
                    || s[i] == '.' && s.get(i + 1).is_some_and(|d| d.is_ascii_digit()))
            {
                i += 1;
            }
        } else if c == ':' && next == Some(':') {
            out.push(Token {
                tok: Tok::PathSep,
                line,
            });
            i += 2;
        } else {
            out.push(Token {
                tok: Tok::Punct(c),
                line,
            });
            i += 1;
        }
    }
    out
}

/// A path as written, from its first segment (`crate`, `super`, ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Path {
    pub segs: Vec<String>,
    /// The name it is imported as (`as X`), when renamed.
    pub alias: Option<String>,
    pub line: usize,
    /// Inside a `pub use` (a re-export).
    pub reexport: bool,
}

/// Every path of one file, with the inline module it was written in
/// (relative to the file's module: empty at the top of the file).
#[derive(Debug, Default)]
pub struct FileScan {
    pub paths: Vec<(Vec<String>, Path)>,
    /// The modules declared (`mod x;` or `mod x { .. }`) per inline scope.
    pub children: Vec<(Vec<String>, String)>,
}

fn ident(t: Option<&Token>) -> Option<&str> {
    match t.map(|t| &t.tok) {
        Some(Tok::Ident(s)) => Some(s),
        _ => None,
    }
}

fn punct(t: Option<&Token>, c: char) -> bool {
    matches!(t.map(|t| &t.tok), Some(Tok::Punct(p)) if *p == c)
}

fn sep(t: Option<&Token>) -> bool {
    matches!(t.map(|t| &t.tok), Some(Tok::PathSep))
}

/// Parses a use tree (or an expression's path) at `toks[*i]` under
/// `prefix`, appending one path per leaf; leaves `*i` after it.
fn tree(toks: &[Token], i: &mut usize, prefix: &[String], out: &mut Vec<Path>) {
    let line = toks.get(*i).map_or(0, |t| t.line);
    let mut segs = prefix.to_vec();
    loop {
        if punct(toks.get(*i), '{') {
            *i += 1;
            while *i < toks.len() && !punct(toks.get(*i), '}') {
                if punct(toks.get(*i), ',') {
                    *i += 1;
                    continue;
                }
                let before = *i;
                tree(toks, i, &segs, out);
                if *i == before {
                    *i += 1; // not a path: step over it
                }
            }
            *i += 1;
            return;
        }
        if punct(toks.get(*i), '*') {
            *i += 1;
            break;
        }
        match ident(toks.get(*i)) {
            // `{self, X}`: the module itself.
            Some("self") if !segs.is_empty() => *i += 1,
            Some(s) => {
                segs.push(s.to_string());
                *i += 1;
            }
            // `Type::<T>`: the path so far; nothing at all: not a path.
            None if segs.len() > prefix.len() => break,
            None => return,
        }
        if sep(toks.get(*i)) {
            *i += 1;
        } else {
            break;
        }
    }
    let alias = match (ident(toks.get(*i)), ident(toks.get(*i + 1))) {
        (Some("as"), Some(a)) => {
            *i += 2;
            Some(a.to_string())
        }
        _ => None,
    };
    out.push(Path {
        segs,
        alias,
        line,
        reexport: false,
    });
}

/// The paths of `src` that start at `crate`, `$crate`, `self`, `super` or
/// a module declared in the file, and every `use` tree.
pub fn scan(src: &str) -> FileScan {
    let toks = lex(src);
    let mut out = FileScan::default();
    // Pass 1: the inline scopes and the modules each declares.
    let mut scopes: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut scope_at = vec![Vec::new(); toks.len()];
    let mut i = 0;
    while i < toks.len() {
        scope_at[i] = scopes.iter().map(|(n, _)| n.clone()).collect();
        match &toks[i].tok {
            Tok::Ident(m) if m == "mod" => {
                if let Some(name) = ident(toks.get(i + 1)) {
                    let here: Vec<String> = scope_at[i].clone();
                    out.children.push((here, name.to_string()));
                    if punct(toks.get(i + 2), '{') {
                        scope_at[i + 1] = scope_at[i].clone();
                        scope_at[i + 2] = scope_at[i].clone();
                        depth += 1;
                        scopes.push((name.to_string(), depth));
                        i += 3;
                        continue;
                    }
                }
            }
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => {
                if scopes.last().is_some_and(|(_, d)| *d == depth) {
                    scopes.pop();
                }
                depth = depth.saturating_sub(1);
            }
            _ => {}
        }
        i += 1;
    }
    let is_child = |scope: &[String], name: &str| {
        out.children
            .iter()
            .any(|(s, n)| s.as_slice() == scope && n == name)
    };
    // Pass 2: the paths.
    let mut found = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        // Every `use` tree (another crate's too: a re-export of one is
        // not an edge, but must be known as such), and elsewhere the paths
        // that start at this crate.
        let after_use = i > 0 && ident(toks.get(i - 1)) == Some("use");
        let starts = match ident(toks.get(i)) {
            Some("crate" | "$crate" | "self" | "super") => sep(toks.get(i + 1)),
            Some(_) if after_use => true,
            Some(name) => is_child(&scope_at[i], name) && sep(toks.get(i + 1)),
            None => after_use && punct(toks.get(i), '{'),
        } && !(i > 0 && (sep(toks.get(i - 1)) || punct(toks.get(i - 1), '.')));
        if !starts {
            i += 1;
            continue;
        }
        // A `pub use` (any visibility) starting here is a re-export.
        let reexport = i >= 2
            && ident(toks.get(i - 1)) == Some("use")
            && (ident(toks.get(i - 2)) == Some("pub") || punct(toks.get(i - 2), ')'));
        let mut paths = Vec::new();
        let scope = scope_at[i].clone();
        tree(&toks, &mut i, &[], &mut paths);
        for mut p in paths {
            p.reexport = reexport;
            found.push((scope.clone(), p));
        }
    }
    out.paths = found;
    out
}
