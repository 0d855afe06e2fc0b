//! The timeline: where an op's time goes, as a Chrome trace (the Trace
//! Event Format, which Perfetto and `chrome://tracing` open).
//!
//! With `KUNGFU_TIMELINE=FILE` (the runtime reads it; `kungfu-bench
//! --timeline FILE` sets it), every worker writes its own file:
//! `FILE` with `%r` replaced by its rank, or, without `%r`, `.rank<R>`
//! put before the extension (`trace.json` -> `trace.rank0.json`). Load
//! them together in <https://ui.perfetto.dev> to see every rank, or render
//! them with `benches/peers/timeline_svg.py`.
//!
//! # What is in it
//!
//! One process per rank (`pid` = rank); in it, row 0 (`ops`) has a span
//! per op, from its start to its completion (its name, kind, bytes, path,
//! strategy and result), and a `queued` span for ops that waited for a
//! swap; row `1 + p` (`peer p`) has what the op did with peer `p`: a span
//! per send of a chunk and step, from hand-off to the wire to its
//! completion, and a span per receive, from the frame's arrival to the end
//! of its reduction or copy (`recv` events). Fast-path ops mark when each
//! peer's contribution was posted and found, and a `reduce` span.
//!
//! Timestamps are microseconds since the UTC midnight before the worker
//! started: the workers of one host share its clock, so their rows line
//! up (workers on other hosts are as far off as the hosts' clocks).
//!
//! # Cost
//!
//! Off (no `KUNGFU_TIMELINE`), a branch per event site. On, an event is
//! formatted into a buffered file under a mutex (a few hundred ns): a
//! profile, not something to leave on in production. The file is flushed
//! when the session closes (or is dropped) and its buffer fills; a worker
//! that is killed loses what was buffered. The JSON array is left open
//! until the end, as the format allows, so a cut file still loads.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kungfu_topology::Rank;

/// The variable the runtime reads.
pub const TIMELINE_VAR: &str = "KUNGFU_TIMELINE";

/// One worker's trace file.
pub struct Timeline {
    rank: u32,
    zero: Instant,
    /// `zero` in microseconds since the UTC midnight before it: every
    /// worker of a host (one clock) stamps events on the same axis.
    zero_us: f64,
    out: Mutex<Option<BufWriter<File>>>,
    path: PathBuf,
}

impl std::fmt::Debug for Timeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Timeline")
            .field("rank", &self.rank)
            .field("path", &self.path)
            .finish()
    }
}

/// The file of rank `rank` for the `KUNGFU_TIMELINE` value `pattern`.
pub fn path_for(pattern: &str, rank: Rank) -> PathBuf {
    if pattern.contains("%r") {
        return PathBuf::from(pattern.replace("%r", &rank.0.to_string()));
    }
    let p = Path::new(pattern);
    let tag = format!("rank{}", rank.0);
    match (p.file_stem(), p.extension()) {
        (Some(stem), Some(ext)) => p.with_file_name(format!(
            "{}.{tag}.{}",
            stem.to_string_lossy(),
            ext.to_string_lossy()
        )),
        _ => PathBuf::from(format!("{pattern}.{tag}")),
    }
}

/// Appends `s` to `out` as the body of a JSON string.
fn escape(out: &mut String, s: &str) {
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
}

/// The row of peer `p`.
pub(crate) fn peer_row(p: Rank) -> u32 {
    p.0 + 1
}

impl Timeline {
    /// Creates rank `rank`'s file for `pattern` (see the module docs) and
    /// writes its metadata (process and row names for `size` ranks).
    pub fn create(pattern: &str, rank: Rank, size: usize) -> std::io::Result<Arc<Timeline>> {
        let path = path_for(pattern, rank);
        let mut out = BufWriter::with_capacity(1 << 20, File::create(&path)?);
        let mut head = String::from("[\n");
        let meta = |head: &mut String, name: &str, tid: u32, value: &str| {
            let _ = writeln!(
                head,
                r#"{{"name":"{name}","ph":"M","pid":{},"tid":{tid},"args":{{"name":"{value}"}}}},"#,
                rank.0
            );
        };
        meta(&mut head, "process_name", 0, &format!("rank {}", rank.0));
        meta(&mut head, "thread_name", 0, "ops");
        for p in (0..size as u32).filter(|&p| p != rank.0) {
            meta(&mut head, "thread_name", p + 1, &format!("peer {p}"));
        }
        out.write_all(head.as_bytes())?;
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let since_midnight = wall.as_micros() % (86_400 * 1_000_000);
        Ok(Arc::new(Timeline {
            rank: rank.0,
            zero: Instant::now(),
            zero_us: since_midnight as f64,
            out: Mutex::new(Some(out)),
            path,
        }))
    }

    /// Where this timeline is written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn us(&self, t: Instant) -> f64 {
        self.zero_us + t.saturating_duration_since(self.zero).as_nanos() as f64 / 1e3
    }

    fn write(&self, event: &str) {
        let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = out.as_mut() {
            // A failed write ends the timeline, not the job.
            if w.write_all(event.as_bytes()).is_err() {
                *out = None;
            }
        }
    }

    /// A span on row `tid` from `start` to `end`; `args` is the body of
    /// a JSON object (may be empty).
    pub(crate) fn span(
        &self,
        tid: u32,
        name: &str,
        cat: &str,
        start: Instant,
        end: Instant,
        args: &str,
    ) {
        let mut e = String::with_capacity(160);
        e.push_str(r#"{"name":""#);
        escape(&mut e, name);
        let _ = writeln!(
            e,
            r#"","cat":"{cat}","ph":"X","ts":{:.3},"dur":{:.3},"pid":{},"tid":{tid},"args":{{{args}}}}},"#,
            self.us(start),
            self.us(end) - self.us(start),
            self.rank
        );
        self.write(&e);
    }

    /// An instant event on row `tid`.
    pub(crate) fn mark(&self, tid: u32, name: &str, cat: &str, at: Instant, args: &str) {
        let mut e = String::with_capacity(128);
        e.push_str(r#"{"name":""#);
        escape(&mut e, name);
        let _ = writeln!(
            e,
            r#"","cat":"{cat}","ph":"i","s":"t","ts":{:.3},"pid":{},"tid":{tid},"args":{{{args}}}}},"#,
            self.us(at),
            self.rank
        );
        self.write(&e);
    }

    /// Writes what is buffered.
    pub fn flush(&self) {
        let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = out.as_mut() {
            if w.flush().is_err() {
                *out = None;
            }
        }
    }

    /// The JSON-escaped `s`, for `args`.
    pub(crate) fn quoted(s: &str) -> String {
        let mut q = String::with_capacity(s.len() + 2);
        q.push('"');
        escape(&mut q, s);
        q.push('"');
        q
    }
}

impl Drop for Timeline {
    fn drop(&mut self) {
        let end = self.us(Instant::now());
        let rank = self.rank;
        let out = self.out.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = out.as_mut() {
            // a last event without a trailing comma closes the array
            let _ = w.write_all(
                format!(
                    r#"{{"name":"end","ph":"i","s":"p","ts":{:.3},"pid":{},"tid":0}}
]
"#,
                    end, rank
                )
                .as_bytes(),
            );
            let _ = w.flush();
        }
    }
}

/// What one op of the message path records (only with a timeline).
pub(crate) struct OpTrace {
    tl: Arc<Timeline>,
    /// Sends handed to the wire and not yet completed.
    sends: Vec<(crate::plan::ActionId, Rank, u32, u16, usize, Instant)>,
}

impl OpTrace {
    pub(crate) fn new(tl: &Arc<Timeline>) -> OpTrace {
        OpTrace {
            tl: tl.clone(),
            sends: Vec::new(),
        }
    }

    /// A send of `bytes` to `to` handed to the wire now.
    pub(crate) fn send(
        &mut self,
        id: crate::plan::ActionId,
        to: Rank,
        h: &kungfu_transport::Header,
        bytes: usize,
    ) {
        self.sends
            .push((id, to, h.chunk, h.step, bytes, Instant::now()));
    }

    /// A send sent at once (injected).
    pub(crate) fn sent_now(&self, to: Rank, h: &kungfu_transport::Header, bytes: usize) {
        let now = Instant::now();
        let name = format!("send {}/{}", h.chunk, h.step);
        self.tl.span(
            peer_row(to),
            &name,
            "send",
            now,
            now,
            &format!(r#""bytes":{bytes},"injected":true"#),
        );
    }

    /// Send `id` completed.
    pub(crate) fn sent(&mut self, id: crate::plan::ActionId) {
        if let Some(i) = self.sends.iter().position(|s| s.0 == id) {
            let (_, to, chunk, step, bytes, start) = self.sends.swap_remove(i);
            let name = format!("send {chunk}/{step}");
            self.tl.span(
                peer_row(to),
                &name,
                "send",
                start,
                Instant::now(),
                &format!(r#""bytes":{bytes}"#),
            );
        }
    }

    /// A frame from `from` taken (reduced or copied) from `start` to now.
    pub(crate) fn recv(
        &self,
        from: Rank,
        h: &kungfu_transport::Header,
        bytes: usize,
        how: &str,
        start: Instant,
    ) {
        let name = format!("recv {}/{}", h.chunk, h.step);
        let args = format!(r#""bytes":{bytes},"how":"{how}""#);
        self.tl
            .span(peer_row(from), &name, "recv", start, Instant::now(), &args);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_per_rank() {
        assert_eq!(path_for("t.json", Rank(3)), PathBuf::from("t.rank3.json"));
        assert_eq!(
            path_for("/x/t-%r.json", Rank(1)),
            PathBuf::from("/x/t-1.json")
        );
        assert_eq!(path_for("trace", Rank(0)), PathBuf::from("trace.rank0"));
    }

    #[test]
    fn events_are_json_even_for_odd_names() {
        let dir = std::env::temp_dir().join(format!("kf-tl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pat = dir.join("t.json");
        let t = Timeline::create(pat.to_str().unwrap(), Rank(0), 2).unwrap();
        let now = Instant::now();
        t.span(0, "a\"b\\c\n", "op", now, now, r#""bytes":4"#);
        t.mark(1, "posted", "fast", now, "");
        let path = t.path().to_path_buf();
        drop(t);
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(
            text.starts_with("[\n") && text.trim_end().ends_with(']'),
            "{text}"
        );
        assert!(text.contains(r#""name":"a\"b\\c\u000a""#), "{text}");
        assert!(text.contains(r#""args":{"name":"peer 1"}"#), "{text}");
        // every line but the brackets is one event object
        for line in text.lines().filter(|l| l.len() > 1) {
            assert!(
                line.starts_with('{') && line.trim_end_matches(',').ends_with('}'),
                "{line}"
            );
        }
    }
}
