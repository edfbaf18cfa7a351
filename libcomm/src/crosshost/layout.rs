//! Which ranks share a host: the shape the hierarchical plans are made for.

use super::links::Exchange;
use crate::error::{Error, Result};

/// The ranks of a communicator grouped by host. Hosts are numbered in the
/// order their lowest rank appears; a host's ranks (its local ranks) in
/// rank order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    hosts: Vec<Vec<usize>>,
    host_of: Vec<usize>,
    local_of: Vec<usize>,
}

impl Layout {
    /// From each rank's host identity (`ids[r]`).
    pub fn from_host_ids(ids: &[u64]) -> Layout {
        let mut keys: Vec<u64> = Vec::new();
        let mut hosts: Vec<Vec<usize>> = Vec::new();
        for (r, id) in ids.iter().enumerate() {
            match keys.iter().position(|k| k == id) {
                Some(h) => hosts[h].push(r),
                None => {
                    keys.push(*id);
                    hosts.push(vec![r]);
                }
            }
        }
        Self::from_hosts(hosts).expect("a partition by construction")
    }

    /// From the ranks of each host; every rank `0..n` exactly once.
    pub fn from_hosts(mut hosts: Vec<Vec<usize>>) -> Result<Layout> {
        let n: usize = hosts.iter().map(Vec::len).sum();
        let mut host_of = vec![usize::MAX; n];
        let mut local_of = vec![0; n];
        hosts.retain(|h| !h.is_empty());
        for h in &mut hosts {
            h.sort_unstable();
        }
        hosts.sort_by_key(|h| h[0]);
        for (hi, h) in hosts.iter().enumerate() {
            for (l, &r) in h.iter().enumerate() {
                if r >= n || host_of[r] != usize::MAX {
                    return Err(Error::arg(format!(
                        "hosts {hosts:?} do not place each of ranks 0..{n} exactly once"
                    )));
                }
                host_of[r] = hi;
                local_of[r] = l;
            }
        }
        Ok(Layout {
            hosts,
            host_of,
            local_of,
        })
    }

    /// `nhosts` hosts of `per_host` ranks, host-major (ranks 0..k on host 0).
    pub fn uniform(nhosts: usize, per_host: usize) -> Layout {
        Self::from_hosts(
            (0..nhosts)
                .map(|h| (h * per_host..(h + 1) * per_host).collect())
                .collect(),
        )
        .expect("a partition")
    }

    /// Ranks in all.
    pub fn n(&self) -> usize {
        self.host_of.len()
    }

    pub fn nhosts(&self) -> usize {
        self.hosts.len()
    }

    pub fn host(&self, r: usize) -> usize {
        self.host_of[r]
    }

    /// `r`'s index among its host's ranks.
    pub fn local(&self, r: usize) -> usize {
        self.local_of[r]
    }

    /// The ranks of host `h`, in rank order.
    pub fn members(&self, h: usize) -> &[usize] {
        &self.hosts[h]
    }

    /// Ranks per host when every host has the same number.
    pub fn per_host(&self) -> Option<usize> {
        let k = self.hosts.first()?.len();
        self.hosts.iter().all(|h| h.len() == k).then_some(k)
    }

    /// Whether every host is one contiguous range of ranks (host h holds
    /// `members(h)[0]..` up to the next host's first rank): then a host's
    /// blocks of a rank-ordered buffer are one range, in local order.
    pub fn contiguous_hosts(&self) -> bool {
        self.hosts
            .iter()
            .all(|h| h.windows(2).all(|w| w[1] == w[0] + 1))
    }

    /// Local rank `l` of every host that has one, in host order (a rail;
    /// on hosts of different sizes the higher rails skip the small hosts).
    pub fn rail(&self, l: usize) -> Vec<usize> {
        self.hosts
            .iter()
            .filter_map(|h| h.get(l).copied())
            .collect()
    }

    /// The rank of host `h` that talks to other hosts for a leader-based
    /// plan: `root` on its own host, else the host's first rank.
    pub fn leader(&self, h: usize, root: Option<usize>) -> usize {
        match root {
            Some(r) if self.host_of[r] == h => r,
            _ => self.hosts[h][0],
        }
    }

    /// The ranks of `r`'s rail on other hosts (the same local index, one
    /// per host: all a rails plan sends to or receives from), when every
    /// host has the same number of ranks; else every remote rank.
    pub fn rail_peers(&self, r: usize) -> Vec<usize> {
        if self.per_host().is_none() {
            return self.remote(r);
        }
        self.rail(self.local(r))
            .into_iter()
            .filter(|&p| p != r)
            .collect()
    }

    /// `r`'s neighbours on its rail's ring in host order, the previous and
    /// the next host's (one rank if there are 2 hosts): all a rails ring or
    /// chain sends to or receives from (chains are rotations of the ring).
    /// Every remote rank when hosts differ in size.
    pub fn ring_peers(&self, r: usize) -> Vec<usize> {
        if self.per_host().is_none() {
            return self.remote(r);
        }
        let rail = self.rail(self.local(r));
        let (h, i) = (rail.len(), self.host(r));
        let mut v = vec![rail[(i + h - 1) % h], rail[(i + 1) % h]];
        v.dedup();
        v.retain(|&p| p != r);
        v
    }

    /// Every rank not on `r`'s host.
    pub fn remote(&self, r: usize) -> Vec<usize> {
        (0..self.n())
            .filter(|&p| self.host_of[p] != self.host_of[r])
            .collect()
    }

    /// For messages: "2 hosts x 3 ranks" or "3 hosts of 2, 1, 2 ranks".
    pub fn describe(&self) -> String {
        match self.per_host() {
            Some(k) => format!("{} host(s) x {k} rank(s)", self.nhosts()),
            None => format!(
                "{} hosts of {:?} ranks",
                self.nhosts(),
                self.hosts.iter().map(Vec::len).collect::<Vec<_>>()
            ),
        }
    }

    /// The layout of the ranks of `world`, from each rank's host identity
    /// (`WEFT_HOSTNAME`, else hostname, boot id and network namespace),
    /// all-gathered over it.
    pub fn gather(world: &dyn Exchange) -> Result<Layout> {
        let name = weft_contract::params::WEFT_HOSTNAME.raw();
        let id = crate::sys::topology::host_id(name.as_deref());
        let all = world.all_gather(&id.to_le_bytes())?;
        let ids = all
            .iter()
            .map(|b| {
                b.get(..8)
                    .and_then(|b| b.try_into().ok())
                    .map(u64::from_le_bytes)
                    .ok_or_else(|| Error::Internal("a host identity of fewer than 8 bytes".into()))
            })
            .collect::<Result<Vec<u64>>>()?;
        Ok(Self::from_host_ids(&ids))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_numbered_by_first_rank_and_rails_line_up() {
        let l = Layout::from_host_ids(&[9, 4, 9, 4, 7]);
        assert_eq!(l.nhosts(), 3);
        assert_eq!(l.members(0), &[0, 2]);
        assert_eq!(l.members(1), &[1, 3]);
        assert_eq!((l.host(3), l.local(3)), (1, 1));
        assert_eq!(l.per_host(), None);
        assert_eq!(l.remote(0), vec![1, 3, 4]);
        assert_eq!(l.leader(1, Some(3)), 3);
        assert_eq!(l.leader(1, Some(0)), 1);
        let u = Layout::uniform(3, 2);
        assert_eq!(u.per_host(), Some(2));
        assert_eq!(u.rail(1), vec![1, 3, 5]);
        assert!(Layout::from_hosts(vec![vec![0, 1], vec![1]]).is_err());
        assert!(Layout::from_hosts(vec![vec![0, 5]]).is_err());
    }
}
