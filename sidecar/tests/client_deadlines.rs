//! Client commands against a sidecar that accepts and never answers: they
//! must give up with a message, not hang (`weft ras` hung for over a minute).

mod common;

use std::os::unix::net::UnixListener;
use std::time::Duration;

use common::*;

#[test]
fn weft_ras_gives_up_on_a_silent_sidecar() {
    let dir = std::env::temp_dir().join(format!("weft-ras-silent-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("sidecar.sock");
    let _ = std::fs::remove_file(&sock);
    let listener = UnixListener::bind(&sock).unwrap();
    // Accept and hold every connection, answer nothing.
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in listener.incoming().flatten() {
            held.push(c);
        }
    });
    let run = weft(&["ras", "--socket", sock.to_str().unwrap(), "--timeout", "1"]);
    assert_eq!(run.code, Some(1), "{}", run.err());
    assert!(
        run.elapsed < Duration::from_secs(5),
        "took {:?}",
        run.elapsed
    );
    assert!(
        run.err().contains("no answer from the sidecar at") && run.err().contains("within 1s"),
        "{}",
        run.err()
    );
    let _ = std::fs::remove_dir_all(&dir);
}
