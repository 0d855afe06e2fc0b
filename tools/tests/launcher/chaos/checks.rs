//! What must hold for the whole of a chaos run, checked at its end from
//! every line kept: each recovery lost exactly its fault's victim, every
//! worker failure kungfu-run reported was a victim's, and every garbage
//! connection was refused (unless its worker was a victim before it read
//! it).

use std::collections::{BTreeMap, BTreeSet};

use super::{Driver, Fault, NP};

impl Driver {
    /// Each recovery names exactly the victim of the fault it follows (a
    /// drop's is whom it names: one worker, an end of the link), and none
    /// follows a fault that must cost nothing.
    pub(super) fn check_recoveries(&mut self) {
        let mut found = Vec::new();
        for (i, l) in self.job.lines.iter().enumerate() {
            let Some(lost) = l
                .msg
                .split_once(": recovered in ")
                .and_then(|(_, r)| r.split_once(" ms: lost "))
                .and_then(|(_, r)| r.split_once("; now "))
                .map(|(lost, _)| lost.to_string())
            else {
                continue;
            };
            let span = self.fig.spans.iter().rposition(|s| s.0 <= i);
            found.push((i, span, lost));
        }
        for (i, span, lost) in found {
            // "R (ADDR), R (ADDR)": the addresses
            let addrs: Vec<&str> = lost
                .split(", ")
                .filter_map(|x| x.split_once(" (")?.1.strip_suffix(')'))
                .collect();
            let Some(k) = span else {
                self.fail(format!(
                    "a recovery before any fault (line {i}): lost {lost}"
                ));
                continue;
            };
            let (_, f, aimed, victims) = self.fig.spans[k].clone();
            let addrs: Vec<String> = addrs.into_iter().map(String::from).collect();
            let ok = match f {
                Fault::Kill | Fault::Freeze => addrs == victims,
                // a cut link: one of its ends, whichever proposed first
                // (runtime/src/recover/machine.rs); every survivor's
                // recovery alike
                Fault::Drop if victims.is_empty() => {
                    let fits = addrs.len() == 1;
                    if fits {
                        self.fig.spans[k].3 = addrs.clone();
                    }
                    fits
                }
                Fault::Drop => addrs == victims,
                Fault::Pause | Fault::Delay | Fault::Garbage => false,
            };
            if !ok {
                self.fail(format!(
                    "{}: a recovery lost {lost}, where the victims were {victims:?} \
                     (aimed at {aimed})",
                    f.name()
                ));
            }
        }
    }

    /// Every worker failure kungfu-run reported is a victim's: a survivor
    /// that panicked or exited 1 in a recovery would be replaced, and
    /// kungfu-run would still exit 0.
    pub(super) fn check_failures(&mut self) {
        let victims: BTreeSet<String> = self
            .fig
            .spans
            .iter()
            .flat_map(|s| s.3.iter().cloned())
            .collect();
        // kungfu-run's label of a first worker is its rank at start
        let first: BTreeMap<String, String> = self
            .job
            .workers
            .iter()
            .take(NP)
            .map(|w| (format!("rank {}", w.label), w.addr.clone()))
            .collect();
        let mut bad = Vec::new();
        for l in self.job.lines.iter().filter(|l| l.label.is_none()) {
            let Some(rest) = l.msg.strip_prefix("kungfu-run: ") else {
                continue;
            };
            if !rest.contains("; the others go on without it") {
                continue;
            }
            let who = rest
                .split(" exited with")
                .next()
                .and_then(|w| w.split(" was killed by").next())
                .and_then(|w| w.split(" could not be").next())
                .and_then(|w| w.split(" ended in").next())
                .unwrap_or_default();
            let addr = who
                .strip_prefix("worker ")
                .map(str::to_string)
                .or_else(|| first.get(who).cloned());
            if !addr.is_some_and(|a| victims.contains(&a)) {
                bad.push(l.msg.clone());
            }
        }
        for b in bad {
            self.fail(format!("a worker that was no victim failed: {b}"));
        }
    }

    /// Whether the worker that garbage connection `g` went to has
    /// connected a cluster version since (a recovery, or a resize when a
    /// replacement joined), and so has read its backlog.
    pub(super) fn garbage_read(&self, &(_, pid, from): &(u16, i32, usize)) -> bool {
        self.job.lines[from..].iter().any(|l| {
            l.pid() == Some(pid)
                && (l.msg.contains(": recovered in ") || l.msg.contains(": resized to "))
        })
    }

    /// Whether that worker is gone (a later fault's victim) without
    /// having read it.
    pub(super) fn garbage_gone(&self, g: &(u16, i32, usize)) -> bool {
        !self.garbage_read(g) && self.job.worker(g.1).is_none_or(|w| !w.alive())
    }

    /// Every garbage connection was read and refused, with a log line,
    /// unless its worker was a later fault's victim before it connected a
    /// version again ([`Driver::flush_garbage`] has the others read
    /// theirs before the end).
    pub(super) fn check_garbage(&mut self) {
        let mut refused = 0;
        let mut gone = 0;
        let mut missed = Vec::new();
        for g in self.fig.garbage.clone() {
            let needle = format!("refused a connection from 127.0.0.1:{}:", g.0);
            let seen = self.job.find(0, |l| l.msg.contains(&needle)).is_some();
            refused += usize::from(seen);
            if !seen {
                if self.garbage_gone(&g) {
                    gone += 1;
                } else {
                    missed.push((g.0, self.garbage_read(&g)));
                }
            }
        }
        if !self.fig.garbage.is_empty() {
            self.fig.tally.entry(Fault::Garbage).or_default().detected = refused;
            self.notes.push(format!(
                "garbage: {} sent, {refused} refused, {gone} gone with their worker (a later \
                 fault's victim) before it was read",
                self.fig.garbage.len()
            ));
        }
        for (p, read) in missed {
            self.fail(if read {
                format!(
                    "garbage: the connection from port {p} was never refused, though its \
                     worker connected a version since"
                )
            } else {
                format!(
                    "garbage: the connection from port {p} was never read: its worker, \
                     alive, never connected a version since"
                )
            });
        }
    }
}
