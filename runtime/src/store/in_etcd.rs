//! A job's keys in etcd (see the module above for the layout): the config
//! and its versions, watched; the workers' member keys under leases; the
//! per-node launchers' states.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kungfu_topology::{Peer, PeerList};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::placement::{encode_ports, note_port, parse_ports, Placement, Ports};
use super::{config_of, parse_change, Change, PutError, HISTORY, MEMBER_TTL_S, WATCH_IDLE};
use crate::elastic::ClusterConfig;
use crate::etcd::{delete_op, put_op, range_op, same_mod, Etcd, Kv};

/// A job's keys in etcd.
#[derive(Clone, Debug)]
pub struct EtcdStore {
    pub(super) etcd: Etcd,
    pub(super) prefix: String,
}

/// What a change reads, at one revision.
pub(super) struct Read {
    pub(super) config: ClusterConfig,
    config_rev: i64,
    rules: Option<Placement>,
    ports: Ports,
}

/// How a job's keys were made.
#[derive(Debug, PartialEq, Eq)]
pub enum Created {
    /// By this call.
    New,
    /// Already, with the same first version: by another launcher of the
    /// job (per-node mode), or by an earlier job of the same id.
    Existing,
}

impl EtcdStore {
    fn key(&self, name: &str) -> String {
        format!("{}/{name}", self.prefix)
    }

    pub(super) fn version_key(&self, v: u32) -> String {
        self.key(&format!("versions/{v:010}"))
    }

    /// Makes the job's keys: version 0 and the rules of `size N`, unless
    /// they exist (another launcher of the job made them: then the first
    /// version must be `initial`).
    pub async fn create(
        &self,
        initial: &ClusterConfig,
        rules: &Placement,
        deadline: Instant,
    ) -> Result<Created, String> {
        let mut ports = Ports::new();
        for p in initial.peers.peers() {
            note_port(&mut ports, &p.host, p.port);
        }
        let text = initial.encode();
        let config = self.key("config");
        let r = self
            .etcd
            .txn(
                vec![same_mod(&config, 0)],
                vec![
                    put_op(&config, &text, 0),
                    put_op(&self.version_key(initial.version), &text, 0),
                    put_op(&self.key("rules"), &rules.encode(), 0),
                    put_op(&self.key("ports"), &encode_ports(&ports), 0),
                ],
                vec![range_op(&self.version_key(initial.version), false)],
                deadline,
            )
            .await?;
        if r.succeeded {
            return Ok(Created::New);
        }
        let first = r.ranges.first().and_then(|kvs| kvs.first());
        match first.map(config_of).transpose()? {
            Some(c) if c == *initial => Ok(Created::Existing),
            other => Err(format!(
                "{} holds another job's config already (version {}: {}): a cluster id or \
                 prefix used twice? Give another, or remove the keys",
                self.prefix,
                initial.version,
                other.map_or_else(|| "absent".into(), |c| c.peers.to_string())
            )),
        }
    }

    pub(super) async fn read(&self, deadline: Instant) -> Result<Read, String> {
        let r = self
            .etcd
            .txn(
                vec![],
                vec![
                    range_op(&self.key("config"), false),
                    range_op(&self.key("rules"), false),
                    range_op(&self.key("ports"), false),
                ],
                vec![],
                deadline,
            )
            .await?;
        let one = |i: usize| r.ranges.get(i).and_then(|kvs| kvs.first());
        let kv = one(0).ok_or_else(|| format!("{}: no config in etcd", self.prefix))?;
        let text = |kv: &Kv| String::from_utf8_lossy(&kv.value).into_owned();
        Ok(Read {
            config: config_of(kv)?,
            config_rev: kv.mod_revision,
            rules: one(1).map(|kv| Placement::parse(&text(kv))).transpose()?,
            ports: one(2).map_or(Ok(Ports::new()), |kv| parse_ports(&text(kv)))?,
        })
    }

    pub(super) async fn put(
        &self,
        body: &str,
        deadline: Instant,
    ) -> Result<ClusterConfig, PutError> {
        let failed = PutError::Failed;
        loop {
            let mut r = self.read(deadline).await.map_err(failed)?;
            let rules = r
                .rules
                .clone()
                .ok_or_else(|| failed(format!("{}: no rules for changes", self.prefix)))?;
            let (next_version, change) = parse_change(body, r.config.version, rules.max_size)?;
            let peers = match change {
                // the size it has: no new version (two launchers that
                // replace the lost at once make one change, not two)
                Change::Size(n) if n == r.config.peers.len() => return Ok(r.config),
                Change::Size(n) => {
                    let peers = rules
                        .resize(&r.config.peers, n, &mut r.ports)
                        .map_err(failed)?;
                    PeerList::new(peers).map_err(|e| failed(e.to_string()))?
                }
                Change::Whole(c) => {
                    let on = |p: &Peer| rules.hosts.iter().any(|(h, _)| *h == p.host);
                    if let Some(p) = c.peers.peers().iter().find(|p| !on(p)) {
                        return Err(failed(format!("{p} is not on a host of the job")));
                    }
                    for p in c.peers.peers() {
                        note_port(&mut r.ports, &p.host, p.port);
                    }
                    c.peers
                }
            };
            let next = ClusterConfig {
                version: next_version,
                peers,
            };
            let text = next.encode();
            let mut ops = vec![
                put_op(&self.key("config"), &text, 0),
                put_op(&self.version_key(next.version), &text, 0),
                put_op(&self.key("ports"), &encode_ports(&r.ports), 0),
            ];
            if let Some(old) = next.version.checked_sub(HISTORY) {
                ops.push(delete_op(&self.version_key(old), false));
            }
            let t = match self
                .etcd
                .txn(
                    vec![same_mod(&self.key("config"), r.config_rev)],
                    ops,
                    vec![],
                    deadline,
                )
                .await
            {
                Ok(t) => t,
                // etcd does not know whether it was made: its version
                // key says (it holds this config if it was), else the
                // change is decided again on the config as it is now
                Err(e) if crate::etcd::UNDECIDED.iter().any(|u| e.contains(u)) => {
                    let undecided = |f: String| {
                        failed(format!(
                            "the change may or may not have been made: {e}; {f}"
                        ))
                    };
                    let (kvs, _) = self
                        .etcd
                        .range(&self.version_key(next.version), false, deadline)
                        .await
                        .map_err(undecided)?;
                    match kvs.first() {
                        Some(kv) if kv.value == text.as_bytes() => return Ok(next),
                        _ => continue,
                    }
                }
                Err(e) => {
                    return Err(failed(format!(
                        "the change may or may not have been made: {e}"
                    )))
                }
            };
            if t.succeeded {
                return Ok(next);
            }
            // another change came between: read it and decide again
        }
    }

    /// The kept versions after `after`, in order, and the revision read
    /// at; an unreadable version is an error of its own (`Ok(Err)`).
    async fn versions_after(
        &self,
        after: u32,
        deadline: Instant,
    ) -> Result<Result<(Vec<ClusterConfig>, i64), String>, String> {
        let (kvs, rev) = self
            .etcd
            .range(&self.key("versions/"), true, deadline)
            .await?;
        let mut out = match kvs.iter().map(config_of).collect::<Result<Vec<_>, _>>() {
            Ok(out) => out,
            Err(e) => return Ok(Err(e)),
        };
        out.retain(|c| c.version > after);
        out.sort_by_key(|c| c.version);
        Ok(Ok((out, rev)))
    }

    pub(super) fn follow(
        self,
        after: u32,
        period: Duration,
        give_up: Duration,
    ) -> mpsc::UnboundedReceiver<Result<ClusterConfig, String>> {
        let (tx, out) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut seen = after;
            let mut reached = Instant::now();
            let prefix = self.key("versions/");
            loop {
                let deadline = Instant::now() + period.max(Duration::from_secs(2));
                // what the last watch may have missed, then a watch from there
                let got = match self.versions_after(seen, deadline).await {
                    Ok(Ok((cs, rev))) => match rev.checked_add(1) {
                        Some(from) => self
                            .etcd
                            .watch(&prefix, from, deadline)
                            .await
                            .map(|w| (cs, w)),
                        None => Err(format!("etcd's revision {rev} cannot grow")),
                    },
                    Ok(Err(bad)) => {
                        let _ = tx.send(Err(bad));
                        return;
                    }
                    Err(e) => Err(e),
                };
                let (cs, mut watch) = match got {
                    Ok(x) => x,
                    Err(e) if reached.elapsed() > give_up => {
                        let _ = tx.send(Err(format!(
                            "the config store {} is unreachable for {give_up:?}: {e}",
                            self.prefix
                        )));
                        return;
                    }
                    Err(_) => {
                        tokio::time::sleep(period).await;
                        continue;
                    }
                };
                reached = Instant::now();
                let mut batch = cs;
                loop {
                    for c in batch.drain(..) {
                        if c.version > seen {
                            seen = c.version;
                            if tx.send(Ok(c)).is_err() {
                                return;
                            }
                        }
                    }
                    match watch.next(Instant::now() + WATCH_IDLE).await {
                        Ok(Some(kvs)) => {
                            reached = Instant::now();
                            for kv in kvs.iter().filter(|kv| !kv.deleted) {
                                match config_of(kv) {
                                    Ok(c) => batch.push(c),
                                    Err(e) => {
                                        let _ = tx.send(Err(e));
                                        return;
                                    }
                                }
                            }
                        }
                        // idle: read again and watch anew
                        Ok(None) => break,
                        // lost: the same, after a pause (a watch that
                        // fails at once is not retried in a spin)
                        Err(_) => {
                            tokio::time::sleep(period).await;
                            break;
                        }
                    }
                    if tx.is_closed() {
                        return;
                    }
                }
            }
        });
        out
    }

    /// Registers `member` (a worker's address) under a lease of its own,
    /// with `value`, renewed until the [`Membership`] is dropped (the key
    /// then expires within [`MEMBER_TTL_S`]) or left.
    pub async fn register(
        &self,
        member: &str,
        value: &str,
        deadline: Instant,
    ) -> Result<Membership, String> {
        self.hold(&format!("members/{member}"), value, deadline)
            .await
    }

    /// Puts the job's key `name` with `value` under a lease of its own,
    /// renewed (and the key put again under a new one if it expired while
    /// etcd was out of reach) until the [`Membership`] is dropped or left.
    async fn hold(&self, name: &str, value: &str, deadline: Instant) -> Result<Membership, String> {
        let id = self.etcd.grant(MEMBER_TTL_S, deadline).await?;
        let key = self.key(name);
        self.etcd
            .txn(vec![], vec![put_op(&key, value, id)], vec![], deadline)
            .await?;
        let etcd = self.etcd.clone();
        let every = Duration::from_millis(MEMBER_TTL_S as u64 * 1000 / 3);
        let value = Arc::new(std::sync::Mutex::new(value.to_string()));
        // the lease in use, which a renewal after an expiry replaces
        let lease = Arc::new(AtomicI64::new(id));
        let (current, now_value, key2) = (lease.clone(), value.clone(), key.clone());
        let task = tokio::spawn(async move {
            let mut written = true;
            loop {
                tokio::time::sleep(every).await;
                let soon = Instant::now() + every;
                let id = current.load(Ordering::Relaxed);
                match etcd.keepalive(id, soon).await {
                    Ok(ttl) if ttl > 0 => {}
                    // expired (etcd unreachable for longer than the TTL):
                    // a new lease, and the key again under it
                    Ok(_) => match etcd.grant(MEMBER_TTL_S, soon).await {
                        Ok(new) => {
                            current.store(new, Ordering::Relaxed);
                            written = false;
                        }
                        Err(_) => continue,
                    },
                    // unreachable: the lease may live on; try again
                    Err(_) => continue,
                }
                if !written {
                    let id = current.load(Ordering::Relaxed);
                    let v = now_value.lock().unwrap_or_else(|e| e.into_inner()).clone();
                    let put = vec![put_op(&key2, &v, id)];
                    written = etcd.txn(vec![], put, vec![], soon).await.is_ok();
                }
            }
        });
        Ok(Membership {
            etcd: self.etcd.clone(),
            key,
            value,
            lease,
            task,
        })
    }

    /// Holds the state of this host's launcher in per-node mode
    /// (`P/launchers/HOST`; see `kungfu-run`'s `config_store`), at first
    /// `state`: [`Membership::update`] changes it.
    pub async fn hold_launcher(
        &self,
        host: &str,
        state: &str,
        deadline: Instant,
    ) -> Result<Membership, String> {
        self.hold(&format!("launchers/{host}"), state, deadline)
            .await
    }

    /// The states of the job's launchers by host, and the current config's
    /// version, read at one revision.
    pub async fn launchers(
        &self,
        deadline: Instant,
    ) -> Result<(Vec<(String, String)>, u32), String> {
        let prefix = self.key("launchers/");
        let r = self
            .etcd
            .txn(
                vec![],
                vec![
                    range_op(&prefix, true),
                    range_op(&self.key("config"), false),
                ],
                vec![],
                deadline,
            )
            .await?;
        let mut states = Vec::new();
        for kv in r.ranges.first().into_iter().flatten() {
            let host = kv
                .key
                .strip_prefix(&prefix)
                .ok_or_else(|| format!("etcd answered a range of {prefix} with {:?}", kv.key))?;
            states.push((
                host.to_string(),
                String::from_utf8_lossy(&kv.value).into_owned(),
            ));
        }
        let config = r.ranges.get(1).and_then(|kvs| kvs.first());
        let config = config.ok_or_else(|| format!("{}: no config in etcd", self.prefix))?;
        Ok((states, config_of(config)?.version))
    }

    /// Removes every key of the job (its launcher, once it is over).
    pub async fn remove(&self, deadline: Instant) -> Result<(), String> {
        let all = delete_op(&format!("{}/", self.prefix), true);
        self.etcd
            .txn(vec![], vec![all], vec![], deadline)
            .await
            .map(|_| ())
    }

    /// The addresses of the live members.
    pub async fn members(&self, deadline: Instant) -> Result<Vec<String>, String> {
        let prefix = self.key("members/");
        let (kvs, _) = self.etcd.range(&prefix, true, deadline).await?;
        kvs.iter()
            .map(|kv| match kv.key.strip_prefix(&prefix) {
                Some(m) => Ok(m.to_string()),
                None => Err(format!(
                    "etcd answered a range of {prefix} with {:?}",
                    kv.key
                )),
            })
            .collect()
    }
}

/// A worker's member key in etcd, kept alive while this lives (and put
/// again, under a new lease, if etcd was out of reach for longer than the
/// lease).
pub struct Membership {
    etcd: Etcd,
    key: String,
    /// What the key holds (put again with it after an expiry).
    value: Arc<std::sync::Mutex<String>>,
    lease: Arc<AtomicI64>,
    task: tokio::task::JoinHandle<()>,
}

impl Membership {
    /// Puts `value` in the key, under its lease.
    pub async fn update(&self, value: &str, deadline: Instant) -> Result<(), String> {
        *self.value.lock().unwrap_or_else(|e| e.into_inner()) = value.to_string();
        let id = self.lease.load(Ordering::Relaxed);
        let put = vec![put_op(&self.key, value, id)];
        self.etcd
            .txn(vec![], put, vec![], deadline)
            .await
            .map(|_| ())
    }

    /// Puts `value` in the key for good (under no lease), and gives the
    /// lease up: the key outlives this (a launcher's `done`).
    pub async fn settle(self, value: &str, deadline: Instant) -> Result<(), String> {
        self.task.abort();
        let put = vec![put_op(&self.key, value, 0)];
        self.etcd.txn(vec![], put, vec![], deadline).await?;
        let id = self.lease.load(Ordering::Relaxed);
        let _ = self.etcd.revoke(id, deadline).await;
        Ok(())
    }

    /// Removes the key now (a worker that exits cleanly).
    pub async fn leave(self, deadline: Instant) {
        self.task.abort();
        let id = self.lease.load(Ordering::Relaxed);
        let _ = self.etcd.revoke(id, deadline).await;
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::etcd::b64;
    use serde_json::json;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A server on the loopback that answers its connections, one request
    /// each, with `replies` in turn (JSON bodies with their status).
    async fn canned(replies: Vec<(u16, serde_json::Value)>) -> String {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            for (code, body) in replies {
                let (mut s, _) = l.accept().await.unwrap();
                let mut req = vec![0u8; 1 << 16];
                let _ = s.read(&mut req).await;
                let body = body.to_string();
                let reply = format!(
                    "HTTP/1.1 {code} x\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(reply.as_bytes()).await;
            }
        });
        addr
    }

    fn kv(key: &str, value: &str, rev: i64) -> serde_json::Value {
        json!({"key": b64(key), "value": b64(value), "mod_revision": rev.to_string()})
    }

    /// A change whose fate etcd does not know (`request timed out`) is
    /// looked up by its version key: made, it is the answer; not made, the
    /// change is decided again and made.
    #[tokio::test]
    async fn an_undecided_change_is_looked_up_and_decided_again() {
        let v0 = ClusterConfig::parse("version 0\npeers 10.0.0.1:100").unwrap();
        let rules = Placement {
            max_size: 4,
            hosts: vec![("10.0.0.1".into(), 4)],
            bounded: true,
            port_base: 100,
        };
        let read = || {
            let ranges = [
                kv("/p/config", &v0.encode(), 5),
                kv("/p/rules", &rules.encode(), 5),
            ]
            .map(|k| json!({"response_range": {"kvs": [k]}}));
            let mut ports = Ports::new();
            note_port(&mut ports, "10.0.0.1", 100);
            let ports = kv("/p/ports", &encode_ports(&ports), 5);
            let ranges = [
                ranges[0].clone(),
                ranges[1].clone(),
                json!({"response_range": {"kvs": [ports]}}),
            ];
            (
                200,
                json!({"header": {"revision": "5"}, "responses": ranges, "succeeded": true}),
            )
        };
        let timed_out = (
            503,
            json!({"error": "etcdserver: request timed out", "code": 14}),
        );
        let v1 = ClusterConfig::parse("version 1\npeers 10.0.0.1:100,10.0.0.1:101").unwrap();
        let store = |addr: String| EtcdStore {
            etcd: Etcd::new(addr),
            prefix: "/p".into(),
        };
        let soon = || Instant::now() + std::time::Duration::from_secs(5);
        let version_key = "/p/versions/0000000001";

        // made: the version key holds it
        let made = (
            200,
            json!({"header": {"revision": "6"}, "kvs": [kv(version_key, &v1.encode(), 6)]}),
        );
        let s = store(canned(vec![read(), timed_out.clone(), made]).await);
        assert_eq!(s.put("size 2", soon()).await.unwrap(), v1);

        // not made: read again, made again
        let absent = (200, json!({"header": {"revision": "6"}}));
        let ok = (200, json!({"header": {"revision": "7"}, "succeeded": true}));
        let s = store(canned(vec![read(), timed_out.clone(), absent, read(), ok]).await);
        assert_eq!(s.put("size 2", soon()).await.unwrap(), v1);

        // the look-up fails too: the caller hears that it may be made
        let s = store(canned(vec![read(), timed_out]).await);
        match s.put("size 2", soon()).await {
            Err(PutError::Failed(e)) => assert!(e.contains("may or may not"), "{e}"),
            other => panic!("{other:?}"),
        }
    }
}
