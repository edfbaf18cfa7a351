//! The parameter registry: every environment variable Weft reads, declared
//! once (in `list.rs`) with its type, default, help and the parts that read
//! it, and typed accessors that parse it with one clear message on a bad
//! value.
//!
//! Reading goes through here only: [`Param::raw`] and friends are the one
//! place Weft calls `std::env::var`. A part that needs a value reads it
//! through its constant, e.g. `params::WEFT_PEER_TIMEOUT_MS.value()`.
//!
//! Conventions of the typed accessors: a variable that is unset, or set to
//! blanks only, is *unset*; numbers are trimmed before they are parsed. A
//! part whose historical semantics differ (an empty value that means "off")
//! reads [`Param::raw`] and keeps its own rule.

use std::collections::HashSet;
use std::ffi::OsString;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Mutex;

mod list;
mod readme;
mod unknown;

pub use list::*;
pub use readme::{README_BEGIN, README_END, readme_table, splice_readme};
pub use unknown::{Unknown, edit_distance, suggest, unknown_vars, warn_unknown_once};

/// How a variable's value is written (drives parsing and the README's "type").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A whole number.
    Int,
    /// Milliseconds.
    Ms,
    /// Bytes.
    Bytes,
    /// KiB.
    Kib,
    /// MiB.
    Mib,
    /// `true`/`false` (also `1`/`0`, `yes`/`no`, `on`/`off`).
    Bool,
    /// `0` turns it off, any other value on.
    OnUnless0,
    /// `1` turns it on, any other value off.
    OnIf1,
    /// Free text.
    Str,
    /// A file or socket path.
    Path,
    /// `host:port`.
    Addr,
    /// One of these words.
    Choice(&'static [&'static str]),
    /// Comma-separated list.
    List,
}

impl Kind {
    /// What a value should look like, for messages ("expected ...").
    pub fn expected(self) -> String {
        match self {
            Kind::Int => "a whole number".into(),
            Kind::Ms => "milliseconds".into(),
            Kind::Bytes => {
                "bytes (a whole number, optionally with K, M, G or T: powers of 1024)".into()
            }
            Kind::Kib => "KiB (a whole number)".into(),
            Kind::Mib => "MiB (a whole number)".into(),
            Kind::Bool => "true or false (1/0, yes/no, on/off)".into(),
            Kind::OnUnless0 => "0 (off) or 1 (on)".into(),
            Kind::OnIf1 => "1 (on) or 0 (off)".into(),
            Kind::Str => "text".into(),
            Kind::Path => "a path".into(),
            Kind::Addr => "HOST:PORT".into(),
            Kind::Choice(words) => format!("one of {}", words.join(", ")),
            Kind::List => "a comma-separated list".into(),
        }
    }
}

/// Which part of Weft reads (or, for the launch contract, sets) a variable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// The communication library (host path).
    Libcomm,
    /// libcomm's CUDA path.
    Cuda,
    /// The C ABI, `libnccl.so.2`.
    Capi,
    /// The rank-side agent that attaches a process to its sidecar.
    Agent,
    /// `weft sidecar`.
    Sidecar,
    /// `weft run`.
    Run,
    /// `weft bench`.
    Bench,
    /// The Kubernetes operator.
    Operator,
    /// Tests and scripts of this repository.
    Tests,
    /// The build (`libcomm/build.rs`, which compiles the CUDA kernels).
    Build,
}

impl Part {
    pub fn label(self) -> &'static str {
        match self {
            Part::Libcomm => "libcomm",
            Part::Cuda => "libcomm (CUDA)",
            Part::Capi => "libnccl",
            Part::Agent => "agent",
            Part::Sidecar => "sidecar",
            Part::Run => "weft run",
            Part::Bench => "weft bench",
            Part::Operator => "operator",
            Part::Tests => "tests",
            Part::Build => "build",
        }
    }
}

/// The README section a variable is listed in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Group {
    /// Communicators: algorithms, transports, timeouts.
    Comm,
    /// The CUDA path (set alike on every rank).
    Cuda,
    /// Sidecar, logging and telemetry.
    Observe,
    /// Set by launchers (`weft run`, the operator) for each rank.
    Launch,
    /// The operator's own settings (its Deployment).
    Operator,
    /// Standard variables read incidentally (not listed in the README).
    System,
    /// Internal to Weft (one part to another), not listed in the README.
    Internal,
    /// Used only by tests and scripts of this repository, not listed in the README.
    Test,
}

impl Group {
    /// The README sections, in order.
    pub const LISTED: [Group; 5] = [
        Group::Comm,
        Group::Cuda,
        Group::Observe,
        Group::Launch,
        Group::Operator,
    ];

    pub fn title(self) -> &'static str {
        match self {
            Group::Comm => "Communicators",
            Group::Cuda => "GPU (set alike on every rank)",
            Group::Observe => "Sidecar, logging and telemetry",
            Group::Launch => "Set by the launcher (`weft run`, the operator) for each rank",
            Group::Operator => "The operator (its Deployment; the Helm chart sets them)",
            Group::System => "Standard variables",
            Group::Internal => "Internal",
            Group::Test => "Tests and scripts",
        }
    }

    /// Listed in the README.
    pub fn listed(self) -> bool {
        Group::LISTED.contains(&self)
    }
}

/// A variable's default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DefaultValue {
    /// A fixed value, written as the variable would be (parsed by [`Param::value`]).
    Value(&'static str),
    /// Worked out at run time; the text says how (README only).
    Computed(&'static str),
    /// Nothing: unset means the feature is off or absent; the text says what
    /// that means ("" when nothing needs saying).
    Unset(&'static str),
}

/// One declared variable.
#[derive(Debug, PartialEq, Eq)]
pub struct ParamSpec {
    pub name: &'static str,
    pub kind: Kind,
    pub default: DefaultValue,
    pub group: Group,
    /// The parts that read it (the launch contract: that set or read it).
    pub parts: &'static [Part],
    /// One line for the README (markdown).
    pub help: &'static str,
}

impl ParamSpec {
    /// Read from the process environment (None: unset, or not Unicode).
    pub fn raw(&self) -> Option<String> {
        std::env::var(self.name).ok()
    }
}

/// A bad value: `NAME=value: expected ...`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamError {
    pub name: &'static str,
    pub value: String,
    pub expected: String,
}

impl fmt::Display for ParamError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}={}: expected {}",
            self.name, self.value, self.expected
        )
    }
}

impl std::error::Error for ParamError {}

/// Types a variable's value parses into, given its [`Kind`].
pub trait FromParam: Sized {
    /// `s` is not blank; it is trimmed unless `kind` is text (`Str`,
    /// `Path`, `Addr`, `List`), which is kept as set.
    fn parse(s: &str, kind: Kind) -> Option<Self>;
}

/// A byte count as `weft bench -b` takes it: a whole number, optionally
/// followed by K, M, G or T (powers of 1024; `KiB`, `MB` and lower case
/// read alike), so `WEFT_CROSSHOST_MIN_BYTES=4M` means what a user means.
/// None on anything else or an overflow.
pub fn parse_bytes(s: &str) -> Option<u64> {
    let s = s.trim();
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(digits);
    let n: u64 = num.parse().ok()?;
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return None,
    };
    n.checked_mul(1u64 << shift)
}

macro_rules! int_from_param {
    ($($t:ty),*) => {$(
        impl FromParam for $t {
            fn parse(s: &str, kind: Kind) -> Option<Self> {
                match kind {
                    Kind::Bytes => parse_bytes(s)?.try_into().ok(),
                    _ => s.parse().ok(),
                }
            }
        }
    )*};
}
int_from_param!(u16, u32, u64, usize, i32, i64);

impl FromParam for bool {
    fn parse(s: &str, kind: Kind) -> Option<Self> {
        match kind {
            Kind::OnUnless0 => Some(s != "0"),
            Kind::OnIf1 => Some(s == "1"),
            _ => match s.to_ascii_lowercase().as_str() {
                "1" | "true" | "yes" | "on" => Some(true),
                "0" | "false" | "no" | "off" => Some(false),
                _ => None,
            },
        }
    }
}

impl FromParam for String {
    fn parse(s: &str, kind: Kind) -> Option<Self> {
        match kind {
            // The canonical spelling of a choice (matched ignoring case).
            Kind::Choice(words) => words
                .iter()
                .find(|w| w.eq_ignore_ascii_case(s))
                .map(|w| w.to_string()),
            _ => Some(s.to_string()),
        }
    }
}

/// Where values come from: the process environment, or a test's table.
pub type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The process environment as a [`Lookup`].
pub fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// A declared variable with the type its value parses into.
pub struct Param<T> {
    spec: &'static ParamSpec,
    _t: PhantomData<fn() -> T>,
}

impl<T> Clone for Param<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Param<T> {}

impl<T> fmt::Debug for Param<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Param({})", self.spec.name)
    }
}

impl<T> Param<T> {
    pub const fn new(spec: &'static ParamSpec) -> Self {
        Param {
            spec,
            _t: PhantomData,
        }
    }

    pub const fn name(&self) -> &'static str {
        self.spec.name
    }

    pub const fn spec(&self) -> &'static ParamSpec {
        self.spec
    }

    /// The fixed default as written (for a command line's `default_value`).
    ///
    /// # Panics
    /// When the default is not a [`DefaultValue::Value`] (at compile time in
    /// a const context).
    pub const fn fixed_default(&self) -> &'static str {
        match self.spec.default {
            DefaultValue::Value(v) => v,
            _ => panic!("this variable has no fixed default"),
        }
    }

    /// The value exactly as set (None: unset, or not Unicode), for parts that
    /// keep their own rule (see the module docs).
    pub fn raw(&self) -> Option<String> {
        self.spec.raw()
    }

    /// The value exactly as set, not necessarily Unicode (paths).
    pub fn raw_os(&self) -> Option<OsString> {
        std::env::var_os(self.spec.name)
    }

    /// Set and not blank.
    pub fn is_set(&self) -> bool {
        self.raw().is_some_and(|v| !v.trim().is_empty())
    }
}

impl<T: FromParam> Param<T> {
    /// The value from `lookup`: `Ok(None)` when unset or blank, an error when
    /// it does not parse.
    pub fn try_get_from(&self, lookup: Lookup<'_>) -> Result<Option<T>, ParamError> {
        let Some(v) = lookup(self.spec.name) else {
            return Ok(None);
        };
        let t = v.trim();
        if t.is_empty() {
            return Ok(None);
        }
        // Text is kept as set; numbers, switches and choices are trimmed.
        let input = match self.spec.kind {
            Kind::Str | Kind::Path | Kind::Addr | Kind::List => v.as_str(),
            _ => t,
        };
        T::parse(input, self.spec.kind).map(Some).ok_or(ParamError {
            name: self.spec.name,
            value: v.clone(),
            expected: self.spec.kind.expected(),
        })
    }

    /// The value from the process environment: `Ok(None)` when unset or blank.
    pub fn try_get(&self) -> Result<Option<T>, ParamError> {
        self.try_get_from(&process_env)
    }

    /// The value from `lookup`; a bad one is reported once (on stderr) and
    /// counts as unset.
    pub fn get_from(&self, lookup: Lookup<'_>) -> Option<T> {
        self.try_get_from(lookup).unwrap_or_else(|e| {
            warn_bad_once(&e);
            None
        })
    }

    /// The value from the process environment; a bad one is reported once
    /// (on stderr) and counts as unset.
    pub fn get(&self) -> Option<T> {
        self.get_from(&process_env)
    }

    /// The declared default ([`DefaultValue::Value`]); None for a computed or no default.
    pub fn default_value(&self) -> Option<T> {
        match self.spec.default {
            DefaultValue::Value(v) => T::parse(v.trim(), self.spec.kind),
            _ => None,
        }
    }

    /// The value from `lookup`, else the declared default.
    ///
    /// # Panics
    /// When the variable has no fixed default (a test checks that every
    /// declared fixed default parses).
    pub fn value_from(&self, lookup: Lookup<'_>) -> T {
        self.get_from(lookup).unwrap_or_else(|| {
            self.default_value().unwrap_or_else(|| {
                panic!(
                    "{} has no fixed default: use get() and work it out",
                    self.spec.name
                )
            })
        })
    }

    /// The value from the process environment, else the declared default
    /// (see [`Param::value_from`]).
    pub fn value(&self) -> T {
        self.value_from(&process_env)
    }
}

/// Reports a bad value once per variable and process.
fn warn_bad_once(e: &ParamError) {
    static SEEN: Mutex<Option<HashSet<&'static str>>> = Mutex::new(None);
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    if seen.get_or_insert_with(HashSet::new).insert(e.name) {
        eprintln!("weft: {e}; using the default");
    }
}

/// Every declared variable, in README order within each group.
pub fn all() -> &'static [&'static ParamSpec] {
    PARAMS
}

/// The declaration of `name`, if any.
pub fn find(name: &str) -> Option<&'static ParamSpec> {
    PARAMS.iter().copied().find(|p| p.name == name)
}

#[cfg(test)]
mod tests;
