//! The import graph of a crate's source directory, file by file: every path
//! a file names (see `scan.rs`) resolved to the file of the deepest module
//! it goes through (`crate::transport::shm::Mapping` -> `transport/shm.rs`,
//! `crate::transport::Chan` -> `transport/mod.rs`).
//!
//! - Re-exports are followed to what they name: `crate::Communicator`
//!   (`pub use comm::Communicator` in `lib.rs`) is `comm`'s file, and a
//!   facade's `pub use` hides no edge (`super::X` re-exported from a
//!   sibling is that sibling). A re-export of another crate is no edge.
//! - A submodule using its ancestors' own items (`super::X` defined in
//!   the parent's file) lives inside their scope, as Rust's privacy sees
//!   it: not an edge. A module using its submodules (a `mod.rs` calling
//!   its children) is an edge like any other.

use super::scan;
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path as FsPath, PathBuf};

/// One import: the file that names it, where, and how it was written.
#[derive(Debug, Clone)]
pub struct Edge {
    pub from: usize,
    pub to: usize,
    pub line: usize,
    pub written: String,
}

#[derive(Debug, Default)]
pub struct Graph {
    /// Files relative to the source directory (`comm/mod.rs`), by index.
    pub files: Vec<String>,
    /// Module path of each file (`["comm"]` for `comm/mod.rs`).
    pub modules: Vec<Vec<String>>,
    pub edges: Vec<Edge>,
}

/// Where a re-export of the root points: a module path of this crate, or
/// another crate.
#[derive(Debug, Clone)]
enum Target {
    Local(Vec<String>),
    External,
}

fn module_of(rel: &FsPath) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().unwrap_or_default();
    let stem = last.trim_end_matches(".rs");
    if !matches!(stem, "mod" | "lib" | "main") || !parts.is_empty() && stem != "mod" {
        parts.push(stem.to_string());
    }
    parts
}

/// Every `.rs` file under `dir`, in a stable order.
pub fn rs_files(dir: &FsPath, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

impl Graph {
    /// The graph of every `.rs` file under `root` (a crate's `src`). With
    /// both `lib.rs` and `main.rs`, `main.rs` is the binary's own crate
    /// (it names the library by its crate name) and is left out.
    pub fn of_dir(root: &FsPath) -> Graph {
        let mut paths = Vec::new();
        rs_files(root, &mut paths);
        let has_lib = paths.iter().any(|p| p == &root.join("lib.rs"));
        let sources: Vec<(String, String)> = paths
            .iter()
            .filter(|p| !(has_lib && *p == &root.join("main.rs")))
            .map(|p| {
                let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
                (rel, fs::read_to_string(p).unwrap())
            })
            .collect();
        Graph::of_sources(&sources)
    }

    /// The graph of `(relative path, source)` pairs (for tests on small inputs).
    pub fn of_sources(sources: &[(String, String)]) -> Graph {
        let mut g = Graph::default();
        for (rel, _) in sources {
            g.files.push(rel.clone());
            g.modules.push(module_of(FsPath::new(rel)));
        }
        let scans: Vec<scan::FileScan> = sources.iter().map(|(_, s)| scan::scan(s)).collect();
        let by_module: BTreeMap<Vec<String>, usize> = g
            .modules
            .iter()
            .enumerate()
            .map(|(i, m)| (m.clone(), i))
            .collect();
        let root = by_module.get(&Vec::new()).copied();
        // Every module's re-exports: (module, name) -> where it points.
        let mut reexports: BTreeMap<(Vec<String>, String), Target> = BTreeMap::new();
        for (f, sc) in scans.iter().enumerate() {
            for (scope, p) in sc
                .paths
                .iter()
                .filter(|(sc, p)| sc.is_empty() && p.reexport)
            {
                let name = p.alias.clone().or_else(|| p.segs.last().cloned());
                let target = absolute(&g.modules[f], &p.segs, sc, scope)
                    .map_or(Target::External, Target::Local);
                if let Some(name) = name.filter(|n| n != "self" && n != "super") {
                    reexports.insert((g.modules[f].clone(), name), target);
                }
            }
        }
        for (from, sc) in scans.iter().enumerate() {
            let here = &g.modules[from];
            for (scope, p) in &sc.paths {
                let Some(abs) = absolute(here, &p.segs, sc, scope) else {
                    continue;
                };
                let Some(to) = resolve(&abs, &by_module, &reexports, root) else {
                    continue;
                };
                // A submodule using its ancestors' items is inside their
                // scope (as Rust's privacy sees it), not an import between
                // modules; a module using its submodules is an import.
                if here.starts_with(&g.modules[to]) {
                    continue;
                }
                g.edges.push(Edge {
                    from,
                    to,
                    line: p.line,
                    written: p.segs.join("::"),
                });
            }
        }
        g
    }

    /// Index of the file of module path `m` (`"comm::group"`), if any.
    pub fn file_of(&self, m: &str) -> Option<usize> {
        let want: Vec<String> = if m.is_empty() {
            Vec::new()
        } else {
            m.split("::").map(String::from).collect()
        };
        self.modules.iter().position(|x| *x == want)
    }

    /// The files each file imports (once each).
    pub fn adjacency(&self) -> Vec<BTreeSet<usize>> {
        let mut adj = vec![BTreeSet::new(); self.files.len()];
        for e in &self.edges {
            adj[e.from].insert(e.to);
        }
        adj
    }

    /// The strongly connected components of more than one file: each is a
    /// set of files that import each other in a circle (sorted by name).
    pub fn cycles(&self) -> Vec<Vec<String>> {
        let adj = self.adjacency();
        let mut sccs = tarjan(&adj);
        sccs.retain(|c| c.len() > 1);
        let mut named: Vec<Vec<String>> = sccs
            .into_iter()
            .map(|c| {
                let mut v: Vec<String> = c.into_iter().map(|i| self.files[i].clone()).collect();
                v.sort();
                v
            })
            .collect();
        named.sort();
        named
    }

    /// One circle through the files of `scc`, as "a.rs:12 crate::b::X ->
    /// b.rs:3 crate::a::Y -> a.rs", for a failure message.
    pub fn describe_cycle(&self, scc: &[String]) -> String {
        let idx: BTreeSet<usize> = scc
            .iter()
            .map(|f| self.files.iter().position(|x| x == f).unwrap())
            .collect();
        let start = *idx.iter().next().unwrap();
        // Breadth-first inside the component, back to `start`.
        let mut prev: BTreeMap<usize, &Edge> = BTreeMap::new();
        let mut queue = std::collections::VecDeque::from([start]);
        let mut seen = BTreeSet::from([start]);
        let mut closing: Option<&Edge> = None;
        'search: while let Some(f) = queue.pop_front() {
            for e in self
                .edges
                .iter()
                .filter(|e| e.from == f && idx.contains(&e.to))
            {
                if e.to == start {
                    closing = Some(e);
                    break 'search;
                }
                if seen.insert(e.to) {
                    prev.insert(e.to, e);
                    queue.push_back(e.to);
                }
            }
        }
        let Some(last) = closing else {
            return scc.join(", ");
        };
        let mut chain = vec![last];
        let mut at = last.from;
        while at != start {
            let e = prev[&at];
            chain.push(e);
            at = e.from;
        }
        chain.reverse();
        let mut s = String::new();
        for e in chain {
            s += &format!("{}:{} `{}` -> ", self.files[e.from], e.line, e.written);
        }
        s + &self.files[start]
    }
}

/// `segs` as an absolute module path, read in the module `base` (the
/// file's) inside inline module `scope`; `None` for another crate's path.
fn absolute(
    base: &[String],
    segs: &[String],
    s: &scan::FileScan,
    scope: &[String],
) -> Option<Vec<String>> {
    let mut here: Vec<String> = base.iter().chain(scope).cloned().collect();
    let first = segs.first()?;
    let rest = match first.as_str() {
        "crate" | "$crate" => {
            here.clear();
            &segs[1..]
        }
        "self" => &segs[1..],
        "super" => {
            let ups = segs.iter().take_while(|x| *x == "super").count();
            for _ in 0..ups {
                here.pop()?;
            }
            &segs[ups..]
        }
        name if s
            .children
            .iter()
            .any(|(sc, n)| sc.as_slice() == scope && n == name) =>
        {
            segs
        }
        _ => return None,
    };
    here.extend(rest.iter().cloned());
    Some(here)
}

/// The file an absolute path goes through last, following re-exports
/// (`super::X` where the parent has `pub use b::X` is `b`'s file); an item
/// of the root that is not a module or a re-export is the root's file.
fn resolve(
    abs: &[String],
    by_module: &BTreeMap<Vec<String>, usize>,
    reexports: &BTreeMap<(Vec<String>, String), Target>,
    root: Option<usize>,
) -> Option<usize> {
    let mut abs = abs.to_vec();
    for _ in 0..8 {
        let deepest = (0..=abs.len())
            .rev()
            .find(|&k| by_module.contains_key(&abs[..k]))?;
        let Some(next) = abs.get(deepest) else {
            return by_module.get(&abs[..]).copied();
        };
        match reexports.get(&(abs[..deepest].to_vec(), next.clone())) {
            Some(Target::Local(to)) => {
                let mut next = to.clone();
                next.extend(abs[deepest + 1..].iter().cloned());
                abs = next;
            }
            Some(Target::External) => return None,
            None => return by_module.get(&abs[..deepest]).copied(),
        }
    }
    root
}

/// Tarjan's strongly connected components.
fn tarjan(adj: &[BTreeSet<usize>]) -> Vec<Vec<usize>> {
    struct St<'a> {
        adj: &'a [BTreeSet<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(st: &mut St, v: usize) {
        st.index[v] = Some(st.next);
        st.low[v] = st.next;
        st.next += 1;
        st.stack.push(v);
        st.on[v] = true;
        for &w in st.adj[v].clone().iter() {
            match st.index[w] {
                None => {
                    visit(st, w);
                    st.low[v] = st.low[v].min(st.low[w]);
                }
                Some(iw) if st.on[w] => st.low[v] = st.low[v].min(iw),
                _ => {}
            }
        }
        if Some(st.low[v]) == st.index[v] {
            let mut c = Vec::new();
            while let Some(w) = st.stack.pop() {
                st.on[w] = false;
                c.push(w);
                if w == v {
                    break;
                }
            }
            st.out.push(c);
        }
    }
    let n = adj.len();
    let mut st = St {
        adj,
        index: vec![None; n],
        low: vec![0; n],
        on: vec![false; n],
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in 0..n {
        if st.index[v].is_none() {
            visit(&mut st, v);
        }
    }
    st.out
}
