use super::*;

/// A fresh directory under the system's temporary one.
fn temp_dir(tag: &str) -> std::path::PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let d = std::env::temp_dir().join(format!(
        "weft-contract-board-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The names on disk, as the launcher, the ranks and Python read them.
#[test]
fn file_names_are_pinned() {
    assert_eq!(DEAD, "dead");
    assert_eq!(RankFile::ready(3, 1).name(), "ready-3-1");
    assert_eq!(RankFile::grow(0, 12).name(), "grow-0-12");
    assert_eq!(RankFile::report(2, 0).name(), "report-2-0");
    assert_eq!(format!("{}", RankFile::grow(17, 4)), "grow-17-4");
}

#[test]
fn rank_files_round_trip() {
    for f in [
        RankFile::ready(0, 0),
        RankFile::grow(4095, MAX_INCARNATION),
        RankFile::report(7, 3),
        RankFile::ready(usize::try_from(u32::MAX).unwrap(), u32::MAX),
    ] {
        assert_eq!(RankFile::parse(&f.name()), Some(f));
    }
    for not in [
        "dead",
        "ready",
        "ready-1",
        "ready-1-",
        "ready--1-0",
        "ready-1-x",
        "ready-1-0-2",
        "Ready-1-0",
        "torch-grow-2-1",
        "ready-12345678901-0",
    ] {
        assert_eq!(RankFile::parse(not), None, "{not}");
    }
}

/// The `dead` line format, byte for byte.
#[test]
fn death_lines_are_pinned() {
    let d = |rank, incarnation, replaced| Death {
        rank,
        incarnation,
        replaced,
    };
    assert_eq!(d(2, 0, true).line(), "2 0 replaced\n");
    assert_eq!(d(5, 3, false).line(), "5 3 final\n");
    assert_eq!(
        dead_file([d(1, 0, true), d(2, 0, true), d(1, 1, false)]),
        "1 0 replaced\n2 0 replaced\n1 1 final\n"
    );
    assert_eq!(dead_file([]), "");
}

#[test]
fn deaths_round_trip() {
    let deaths = vec![
        Death {
            rank: 0,
            incarnation: 0,
            replaced: true,
        },
        Death {
            rank: 4095,
            incarnation: 17,
            replaced: false,
        },
        Death {
            rank: 3,
            incarnation: u32::MAX,
            replaced: true,
        },
    ];
    for d in &deaths {
        let line = d.line();
        assert_eq!(Death::parse_line(line.trim_end_matches('\n')), Ok(*d));
    }
    assert_eq!(parse_dead(&dead_file(deaths.clone())), deaths);
}

/// Lines that are not deaths are refused one by one with a typed error; a
/// file's other lines still count.
#[test]
fn malformed_death_lines_are_refused() {
    for bad in [
        "",
        "1",
        "1 0",
        "x 0 replaced",
        "1 -1 replaced",
        "1 0 maybe",
        "1 0 replaced extra",
        "1 99999999999 replaced",
        "-1 0 final",
    ] {
        assert!(
            matches!(Death::parse_line(bad), Err(BoardError::MalformedDeath(_))),
            "{bad:?}"
        );
    }
    let body = "1 0 replaced\ngarbage\n2 1 final\n\n";
    assert_eq!(
        parse_dead(body),
        vec![
            Death {
                rank: 1,
                incarnation: 0,
                replaced: true
            },
            Death {
                rank: 2,
                incarnation: 1,
                replaced: false
            }
        ]
    );
}

#[test]
fn names_are_classified() {
    assert_eq!(
        classify("ready-3-1", 4),
        Ok(Entry::Rank(RankFile::ready(3, 1)))
    );
    assert_eq!(
        classify("grow-0-12", 4),
        Ok(Entry::Rank(RankFile::grow(0, 12)))
    );
    assert!(classify("report-2-0", 4).unwrap().is_report());
    // A program's own files are relayed as they are.
    for other in [
        "torch-store-grow4-0.0-1.0",
        "torch-grow-2-1",
        "notes",
        "other-1-0",
    ] {
        assert_eq!(classify(other, 4), Ok(Entry::Other), "{other}");
    }
}

/// Hostile names: paths, temporary files, `dead`, oversize, out-of-range
/// ranks and incarnations.
#[test]
fn hostile_names_are_refused() {
    let long = "x".repeat(MAX_NAME + 1);
    for bad in [
        "dead",
        "../ready-1-0",
        "ready-1-0/..",
        ".ready-1-0.123",
        "a b",
        "",
        "é",
        long.as_str(),
    ] {
        assert!(
            matches!(classify(bad, 4), Err(BoardError::UnsafeName(_))),
            "{bad:?}"
        );
    }
    assert_eq!(classify(&"x".repeat(MAX_NAME), 4), Ok(Entry::Other));
    for bad in ["ready-1", "ready--1-0", "ready-1-x", "grow-1-99999999999"] {
        assert!(
            matches!(classify(bad, 4), Err(BoardError::MalformedName(_))),
            "{bad:?}"
        );
    }
    assert_eq!(
        classify("ready-4-0", 4),
        Err(BoardError::RankOutOfRange { rank: 4, world: 4 })
    );
    assert_eq!(
        classify(&format!("grow-1-{}", MAX_INCARNATION + 1), 4),
        Err(BoardError::IncarnationTooLarge(MAX_INCARNATION + 1))
    );
    // The error names a clipped copy of a hostile name.
    let huge = "/".repeat(10_000);
    let Err(BoardError::UnsafeName(shown)) = classify(&huge, 4) else {
        panic!("not refused");
    };
    assert_eq!(shown.len(), 64);
}

#[test]
fn bounds_are_checked() {
    assert!(check_body("grow-1-0", &"x".repeat(MAX_BODY)).is_ok());
    assert_eq!(
        check_body("grow-1-0", &"x".repeat(MAX_BODY + 1)),
        Err(BoardError::BodyTooLarge {
            name: "grow-1-0".into(),
            len: MAX_BODY + 1
        })
    );
    assert!(check_post_items(MAX_POST_ITEMS).is_ok());
    assert_eq!(
        check_post_items(MAX_POST_ITEMS + 1),
        Err(BoardError::TooManyItems(MAX_POST_ITEMS + 1))
    );
    assert!(check_room(MAX_ENTRIES - 1, 1).is_ok());
    assert_eq!(check_room(MAX_ENTRIES, 1), Err(BoardError::Full));
    assert_eq!(check_room(usize::MAX, 1), Err(BoardError::Full));
    let death = |rank, incarnation| Death {
        rank,
        incarnation,
        replaced: true,
    };
    assert!(death(3, MAX_INCARNATION).check(4).is_ok());
    assert_eq!(
        death(4, 0).check(4),
        Err(BoardError::RankOutOfRange { rank: 4, world: 4 })
    );
    assert_eq!(
        death(0, MAX_INCARNATION + 1).check(4),
        Err(BoardError::IncarnationTooLarge(MAX_INCARNATION + 1))
    );
}

#[test]
fn a_grow_is_replaced_only_by_a_newer_one() {
    assert!(replaces(None, "anything"));
    assert!(replaces(Some("1 4 3 7 abcd"), "2 4 3 8 ef"));
    assert!(!replaces(Some("2 4 3 8 ef"), "1 4 3 7 abcd"));
    assert!(!replaces(Some("2 4 3 8 ef"), "2 4 3 8 ef"));
    // Files without a leading sequence never change once written.
    assert!(!replaces(Some(""), ""));
    assert!(!replaces(Some("host 29500"), "host 29501"));
}

/// The atomic write leaves exactly the file (no temporary one), replaces
/// an old one whole, and what it wrote reads back as it was given.
#[test]
fn atomic_writes_leave_the_file_whole() {
    let dir = temp_dir("write");
    let deaths = [
        Death {
            rank: 1,
            incarnation: 0,
            replaced: true,
        },
        Death {
            rank: 2,
            incarnation: 0,
            replaced: false,
        },
    ];
    assert_eq!(read_dead(&dir), vec![], "no file yet");
    write_atomic(&dir, DEAD, &dead_file(deaths)).unwrap();
    write_atomic(&dir, &RankFile::ready(3, 1).name(), "").unwrap();
    write_atomic(&dir, "grow-3-1", "1 4 3 7 abcd\n").unwrap();
    write_atomic(&dir, "grow-3-1", "2 4 3 8 ef\n").unwrap();
    assert_eq!(
        std::fs::read_to_string(dir.join("dead")).unwrap(),
        "1 0 replaced\n2 0 final\n"
    );
    assert_eq!(read_dead(&dir), deaths.to_vec());
    assert_eq!(
        std::fs::read_to_string(dir.join("grow-3-1")).unwrap(),
        "2 4 3 8 ef\n"
    );
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["dead", "grow-3-1", "ready-3-1"]);
    // A board that is gone: an error, and no temporary file left behind.
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(write_atomic(&dir, DEAD, "").is_err());
}

/// Writers racing on one name in one process each rename a whole file of
/// their own: the result is one of the bodies, never a mix.
#[test]
fn concurrent_writers_do_not_mix() {
    let dir = temp_dir("race");
    let bodies: Vec<String> = (0..8u8)
        .map(|i| ((b'a' + i) as char).to_string().repeat(MAX_BODY))
        .collect();
    std::thread::scope(|s| {
        for b in &bodies {
            let dir = &dir;
            s.spawn(move || {
                for _ in 0..50 {
                    write_atomic(dir, "grow-0-1", b).unwrap();
                }
            });
        }
    });
    let got = std::fs::read_to_string(dir.join("grow-0-1")).unwrap();
    assert!(bodies.contains(&got), "a mixed file of {} bytes", got.len());
    let _ = std::fs::remove_dir_all(&dir);
}
