//! Hosts as network namespaces on one machine: a "switch" namespace with a
//! bridge, and per host a namespace with one veth into it and its own
//! address in 10.200.0.0/24 (which exists only inside these namespaces).
//! Everything is deleted on drop.

use std::process::Command;

pub struct Net {
    pub switch: String,
    pub hosts: Vec<String>,
    pub addrs: Vec<String>,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("running ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl Net {
    /// `Err(reason)` when namespaces cannot be made here (the test then skips).
    pub fn create(hosts: usize) -> Result<Net, String> {
        let tag = format!(
            "wft{}x{}",
            std::process::id() % 100_000,
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let mut net = Net {
            switch: format!("{tag}s"),
            hosts: Vec::new(),
            addrs: Vec::new(),
        };
        ip(&["netns", "add", &net.switch])?;
        let s = net.switch.clone();
        ip(&["-n", &s, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &s, "link", "set", "br0", "up"])?;
        for h in 0..hosts {
            let ns = format!("{tag}h{h}");
            ip(&["netns", "add", &ns])?;
            net.hosts.push(ns.clone());
            let port = format!("p{h}");
            ip(&[
                "-n", &s, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns",
                &ns,
            ])?;
            ip(&["-n", &s, "link", "set", &port, "master", "br0"])?;
            ip(&["-n", &s, "link", "set", &port, "up"])?;
            let addr = format!("10.200.0.{}", h + 1);
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                "eth0",
            ])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            net.addrs.push(addr);
        }
        Ok(net)
    }

    /// Cuts host `h`'s link (its switch port goes down).
    pub fn cut(&self, h: usize) {
        ip(&["-n", &self.switch, "link", "set", &format!("p{h}"), "down"])
            .expect("cutting the link");
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in self.hosts.iter().chain(std::iter::once(&self.switch)) {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

/// Moves the calling process into network namespace `name` (ranks call this first).
pub fn enter(name: &str) -> Result<(), String> {
    let path = format!("/var/run/netns/{name}");
    let f = std::fs::File::open(&path).map_err(|e| format!("{path}: {e}"))?;
    use std::os::fd::AsRawFd;
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(format!("setns {name}: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Runs `f` on a thread inside network namespace `name` (setns affects the
/// calling thread only): how the test process reaches a host's sockets.
pub fn within<T: Send + 'static>(name: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let name = name.to_string();
    std::thread::spawn(move || {
        enter(&name).expect("entering the namespace");
        f()
    })
    .join()
    .expect("thread inside the namespace")
}
