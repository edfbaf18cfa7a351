//! README.md's configuration table, generated from the registry.

use super::{DefaultValue, Group, Kind, PARAMS, ParamSpec};
use std::fmt::Write;

/// The marker lines around the generated table in README.md.
pub const README_BEGIN: &str = "<!-- params:begin -->";
pub const README_END: &str = "<!-- params:end -->";

fn default_cell(p: &ParamSpec) -> String {
    match p.default {
        DefaultValue::Value(v) => match p.kind {
            Kind::Int => v.to_string(),
            Kind::Ms => format!("{v} ms"),
            Kind::Bytes => format!("{v} bytes"),
            Kind::Kib => format!("{v} KiB"),
            Kind::Mib => format!("{v} MiB"),
            _ => format!("`{v}`"),
        },
        DefaultValue::Computed(t) => t.to_string(),
        DefaultValue::Unset("") => "unset".to_string(),
        DefaultValue::Unset(t) => t.to_string(),
    }
}

/// The markdown between [`README_BEGIN`] and [`README_END`]: one table per
/// listed [`Group`], hidden groups (tests, internal, standard) left out.
pub fn readme_table() -> String {
    let mut o = String::new();
    o.push_str(
        "<!-- Generated from contract/src/params/list.rs: edit that, then run\n     \
         `cargo run -p weft-contract --example readme-params` to rewrite this table. -->\n",
    );
    for g in Group::LISTED {
        let _ = write!(o, "\n**{}**\n\n", g.title());
        o.push_str("| variable | meaning | default | used by |\n| --- | --- | --- | --- |\n");
        for p in PARAMS.iter().filter(|p| p.group == g) {
            let parts: Vec<&str> = p.parts.iter().map(|p| p.label()).collect();
            let _ = writeln!(
                o,
                "| `{}` | {} | {} | {} |",
                p.name,
                p.help,
                default_cell(p),
                parts.join(", ")
            );
        }
    }
    o
}

/// `readme` with the text between the markers replaced by `table`; None when
/// the markers are missing or out of order.
pub fn splice_readme(readme: &str, table: &str) -> Option<String> {
    let b = readme.find(README_BEGIN)? + README_BEGIN.len();
    let e = readme[b..].find(README_END)? + b;
    Some(format!("{}\n{}{}", &readme[..b], table, &readme[e..]))
}
