//! Rewrites README.md's configuration table from the registry
//! (`cargo run -p weft-contract --example readme-params`); with `--print`,
//! prints the table instead.

use weft_contract::params::{README_BEGIN, README_END, readme_table, splice_readme};

fn main() {
    let table = readme_table();
    if std::env::args().any(|a| a == "--print") {
        print!("{README_BEGIN}\n{table}{README_END}\n");
        return;
    }
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md");
    let readme = std::fs::read_to_string(&path).expect("reading README.md");
    let Some(new) = splice_readme(&readme, &table) else {
        eprintln!("README.md lacks the {README_BEGIN} / {README_END} markers");
        std::process::exit(1);
    };
    if new != readme {
        std::fs::write(&path, new).expect("writing README.md");
        eprintln!("README.md: configuration table rewritten");
    }
}
