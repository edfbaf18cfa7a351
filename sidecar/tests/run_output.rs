//! `weft run` prefixes each rank's lines and never splits them.

mod common;

use common::*;

#[test]
fn lines_are_prefixed_on_stdout_and_stderr() {
    let run = weft(&[
        "run",
        "-n",
        "2",
        "--",
        "sh",
        "-c",
        r#"printf 'a\nb\npartial'; printf 'e1\nepart' >&2"#,
    ]);
    assert_eq!(run.code, Some(0), "{}", run.err());
    for rank in 0..2 {
        let mine = |s: String| -> Vec<String> {
            s.lines()
                .filter_map(|l| {
                    split_prefix(l)
                        .filter(|(r, _)| *r == rank)
                        .map(|(_, x)| x.to_string())
                })
                .collect()
        };
        assert_eq!(
            mine(run.out()),
            ["a", "b", "partial"],
            "stdout of rank {rank}"
        );
        assert_eq!(mine(run.err()), ["e1", "epart"], "stderr of rank {rank}");
    }
    assert!(run.out().ends_with('\n'), "the partial line is terminated");
    assert_eq!(run.out().lines().count(), 6);
}

#[test]
fn no_prefix_passes_output_through() {
    let run = weft(&[
        "run",
        "--no-prefix",
        "-n",
        "2",
        "--",
        "sh",
        "-c",
        "echo x$RANK",
    ]);
    assert_eq!(run.code, Some(0));
    let mut lines: Vec<_> = run.out().lines().map(String::from).collect();
    lines.sort();
    assert_eq!(lines, ["x0", "x1"]);
}

#[test]
fn prefix_is_padded_for_many_ranks() {
    let run = weft(&["run", "-n", "12", "--", "sh", "-c", "echo r$RANK"]);
    assert_eq!(run.code, Some(0));
    let out = run.out();
    assert!(out.lines().any(|l| l == "[ 3] r3"), "{out}");
    assert!(out.lines().any(|l| l == "[11] r11"), "{out}");
}

#[test]
fn invalid_utf8_is_passed_bytewise() {
    let run = weft(&["run", "-n", "1", "--", "sh", "-c", r"printf '\377\376x\n'"]);
    assert_eq!(run.code, Some(0));
    assert_eq!(run.stdout, b"[0] \xff\xfex\n");
}

#[test]
fn concurrent_long_lines_never_interleave() {
    // 4 ranks x 200 lines of 2 KB, all at once: every line must come out whole.
    let script = r#"l=$(printf "%02000d" 0); i=0; while [ $i -lt 200 ]; do echo "$RANK$l"; i=$((i+1)); done"#;
    let run = weft(&["run", "-n", "4", "--", "sh", "-c", script]);
    assert_eq!(run.code, Some(0));
    let mut counts = [0usize; 4];
    for line in run.out().lines() {
        let (rank, body) = split_prefix(line).unwrap_or_else(|| panic!("bad line {line:.40}"));
        assert_eq!(body.len(), 2001, "line of rank {rank} was split");
        assert_eq!(body[..1], rank.to_string());
        assert!(body[1..].bytes().all(|b| b == b'0'));
        counts[rank] += 1;
    }
    assert_eq!(counts, [200; 4]);
}

#[test]
fn arguments_after_the_command_belong_to_it() {
    // Without `--`, options after CMD (even weft's own names) are CMD's arguments.
    let run = weft(&[
        "run",
        "-n",
        "1",
        "sh",
        "-c",
        "echo \"$@\"",
        "sh",
        "--timeout",
        "-n",
        "5",
    ]);
    assert_eq!(run.code, Some(0), "{}", run.err());
    assert_eq!(run.out(), "[0] --timeout -n 5\n");
}

#[test]
fn over_long_lines_are_written_in_pieces_without_loss() {
    // 200 KB without a newline exceeds the 64 KiB line buffer: it is written in
    // pieces, only the first prefixed, and not a byte is lost or added.
    let script = r#"head -c 200000 /dev/zero | tr '\0' a; echo"#;
    let run = weft(&["run", "-n", "1", "--", "sh", "-c", script]);
    assert_eq!(run.code, Some(0));
    let mut want = b"[0] ".to_vec();
    want.extend(std::iter::repeat_n(b'a', 200_000));
    want.push(b'\n');
    assert!(run.stdout == want, "got {} bytes", run.stdout.len());
}
