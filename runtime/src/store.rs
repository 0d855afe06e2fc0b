//! Where an elastic job's cluster config lives: the launcher's built-in
//! HTTP server ([`crate::elastic`], `http://...`, the default) or etcd
//! (`etcd://host:port/prefix`, `kungfu-run --config-store`), for clusters
//! that run it already. `KUNGFU_CONFIG_SERVER` names either; workers and
//! launchers use [`ConfigStore`] and do not care which.
//!
//! # The keys in etcd
//!
//! Under the job's prefix `P` (`kungfu-run` makes it `/kungfu/<cluster
//! id>` under the URL's path):
//!
//! ```text
//! P/config              the current config (ClusterConfig::encode's text)
//! P/versions/0000000003 every version, the last 64 kept (GET /cluster/V)
//! P/rules               where `size N` puts new workers (Placement)
//! P/ports               the highest port each host has given out
//! P/members/HOST:PORT   one key per live worker, under its own lease
//! P/launchers/HOST      per-node mode: what each host's launcher runs
//! ```
//!
//! A change is a transaction that holds only if `P/config` is unchanged
//! since it was read (its mod revision), and writes the config, its
//! version key and the ports together: versions are linearisable, and of
//! two workers that propose the same version one wins and the other gets
//! [`PutError::Conflict`], as with the built-in server's 409. Launchers
//! watch `P/versions/` (every version, in order). A worker's member key
//! is bound to a lease it renews: a worker that dies loses its key within
//! [`MEMBER_TTL_S`] seconds.
//!
//! The client speaks plain HTTP to etcd's JSON gateway
//! ([`crate::etcd`]): no TLS, no etcd users. Reach an etcd that only the
//! job's hosts can (the job's own handshake still refuses a peer without
//! the job's secret).

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kungfu_topology::{Peer, PeerList};
use kungfu_transport::auth::JobSecret;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::elastic::{self, ClusterConfig};
use crate::etcd::{delete_op, put_op, range_op, same_mod, Etcd, Kv};

/// The largest cluster the rules may allow (what `size N` builds is
/// bounded by it).
const MAX_SIZE: usize = 1 << 16;
/// How many versions are kept (as the built-in server keeps).
const HISTORY: u32 = 64;
/// A member key's lease, in seconds; it is renewed every third of it.
pub const MEMBER_TTL_S: i64 = 5;
/// An etcd watch with nothing new is opened anew this often (each time
/// after reading what it may have missed): a store gone silent is noticed.
const WATCH_IDLE: Duration = Duration::from_secs(5);

/// Why a change of the config was not made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PutError {
    /// Another change came first: the version given is not the next one.
    Conflict(String),
    Failed(String),
}

impl std::fmt::Display for PutError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PutError::Conflict(e) | PutError::Failed(e) => f.write_str(e),
        }
    }
}

/// A change of the config, as a client asks for it.
pub(crate) enum Change {
    /// `size N`: the first `N` kept, new workers where the store's rules say.
    Size(usize),
    /// A whole config, of the next version.
    Whole(ClusterConfig),
}

/// Reads a change (`size N`, or a whole config) of a config at version
/// `cur`; returns the next version with it. `max_size` bounds either.
pub(crate) fn parse_change(
    body: &str,
    cur: u32,
    max_size: usize,
) -> Result<(u32, Change), PutError> {
    let bad = PutError::Failed;
    let next = cur
        .checked_add(1)
        .ok_or_else(|| bad("the version cannot grow further".into()))?;
    let body = body.trim();
    if let Some(n) = body.strip_prefix("size ") {
        let n: usize = n
            .trim()
            .parse()
            .map_err(|_| bad(format!("bad size {n:?}")))?;
        if n == 0 || n > max_size {
            return Err(bad(format!("size {n} is outside 1..={max_size}")));
        }
        return Ok((next, Change::Size(n)));
    }
    let c = ClusterConfig::parse(body).map_err(bad)?;
    if c.version != next {
        let v = c.version;
        return Err(PutError::Conflict(format!(
            "version {v} given; the next version is {next}"
        )));
    }
    if c.peers.len() > max_size {
        return Err(bad(format!("{} peers; at most {max_size}", c.peers.len())));
    }
    Ok((next, Change::Whole(c)))
}

/// Where `size N` puts new workers, for a store that has no launcher in
/// the path (etcd): as the built-in server of a job across hosts does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// The largest cluster.
    pub max_size: usize,
    /// The hosts, in order, with their slots.
    pub hosts: Vec<(String, usize)>,
    /// Whether the slots bound the workers of a host (else every new
    /// worker goes on the first host).
    pub bounded: bool,
    /// The first port of a host's workers.
    pub port_base: u16,
}

impl Placement {
    pub fn encode(&self) -> String {
        let hosts: Vec<String> = self.hosts.iter().map(|(h, s)| format!("{h}={s}")).collect();
        format!(
            "max {}\nbounded {}\nport_base {}\nhosts {}\n",
            self.max_size,
            self.bounded,
            self.port_base,
            hosts.join(",")
        )
    }

    pub fn parse(text: &str) -> Result<Placement, String> {
        let mut p = Placement {
            max_size: 0,
            hosts: Vec::new(),
            bounded: false,
            port_base: 0,
        };
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let bad = || format!("bad rules line {line:?}");
            let (k, v) = line.split_once(' ').ok_or_else(bad)?;
            match k {
                "max" => p.max_size = v.parse().map_err(|_| bad())?,
                "bounded" => p.bounded = v.parse().map_err(|_| bad())?,
                "port_base" => p.port_base = v.parse().map_err(|_| bad())?,
                "hosts" => {
                    for h in v.split(',') {
                        let (host, slots) = h.rsplit_once('=').ok_or_else(bad)?;
                        p.hosts
                            .push((host.into(), slots.parse().map_err(|_| bad())?));
                    }
                }
                _ => return Err(bad()),
            }
        }
        if p.hosts.is_empty() || p.max_size == 0 {
            return Err("rules without hosts or size".into());
        }
        if p.max_size > MAX_SIZE {
            return Err(format!(
                "rules for {} workers; at most {MAX_SIZE}",
                p.max_size
            ));
        }
        Ok(p)
    }

    /// The peers of `size n` from `cur`: the first `n` kept, new ones
    /// added where there is room, at the next port of their host
    /// (`ports`, updated).
    fn resize(&self, cur: &PeerList, n: usize, ports: &mut Ports) -> Result<Vec<Peer>, String> {
        if n == 0 || n > self.max_size {
            return Err(format!("size {n} is outside 1..={}", self.max_size));
        }
        let mut peers: Vec<Peer> = cur.peers().iter().take(n).cloned().collect();
        while peers.len() < n {
            let room = |(h, slots): &&(String, usize)| {
                !self.bounded || peers.iter().filter(|p| &p.host == h).count() < *slots
            };
            let (host, _) = self
                .hosts
                .iter()
                .find(room)
                .ok_or("all slots of the job's hosts are taken")?;
            let port = match ports.iter().find(|(h, _)| h == host) {
                Some((_, last)) => last
                    .checked_add(1)
                    .ok_or_else(|| format!("no port left on {host}"))?,
                None => self.port_base,
            };
            note_port(ports, host, port);
            peers.push(Peer {
                host: host.clone(),
                port,
            });
        }
        Ok(peers)
    }
}

/// The highest port each host has given out.
type Ports = Vec<(String, u16)>;

fn note_port(ports: &mut Ports, host: &str, port: u16) {
    match ports.iter_mut().find(|(h, _)| h == host) {
        Some((_, last)) => *last = (*last).max(port),
        None => ports.push((host.to_string(), port)),
    }
}

fn encode_ports(ports: &Ports) -> String {
    ports.iter().map(|(h, p)| format!("{h} {p}\n")).collect()
}

fn parse_ports(text: &str) -> Result<Ports, String> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let (h, p) = l
                .rsplit_once(' ')
                .ok_or_else(|| format!("bad ports line {l:?}"))?;
            Ok((
                h.to_string(),
                p.parse().map_err(|_| format!("bad port {p:?}"))?,
            ))
        })
        .collect()
}

/// The config store of an elastic job.
#[derive(Clone, Debug)]
pub enum ConfigStore {
    /// The launcher's built-in server (`http://host:port/cluster`).
    Http(String),
    Etcd(EtcdStore),
}

/// A job's keys in etcd.
#[derive(Clone, Debug)]
pub struct EtcdStore {
    etcd: Etcd,
    prefix: String,
}

impl ConfigStore {
    /// The store `url` names: `http://...` or `etcd://host:port/prefix`.
    pub fn open(url: &str) -> Result<ConfigStore, String> {
        if url.starts_with("http://") {
            return Ok(ConfigStore::Http(url.to_string()));
        }
        let rest = url.strip_prefix("etcd://").ok_or_else(|| {
            format!(
                "{url:?}: a config store is http://HOST:PORT/cluster or etcd://HOST:PORT/PREFIX"
            )
        })?;
        let (addr, prefix) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        let prefix = prefix.trim_end_matches('/');
        if addr.is_empty() || prefix.is_empty() {
            return Err(format!(
                "{url:?}: etcd://HOST:PORT/PREFIX needs an address and a prefix"
            ));
        }
        Ok(ConfigStore::Etcd(EtcdStore {
            etcd: Etcd::new(addr),
            prefix: prefix.to_string(),
        }))
    }

    /// The URL workers get (`KUNGFU_CONFIG_SERVER`).
    pub fn url(&self) -> String {
        match self {
            ConfigStore::Http(u) => u.clone(),
            ConfigStore::Etcd(e) => format!("etcd://{}{}", e.etcd.addr(), e.prefix),
        }
    }

    /// The current config.
    pub async fn get(&self, deadline: Instant) -> Result<ClusterConfig, String> {
        match self {
            ConfigStore::Http(u) => elastic::get_config(u, deadline).await,
            ConfigStore::Etcd(e) => e.read(deadline).await.map(|r| r.config),
        }
    }

    /// Version `v`, if it was made and is still kept.
    pub async fn get_version(
        &self,
        v: u32,
        deadline: Instant,
    ) -> Result<Option<ClusterConfig>, String> {
        match self {
            ConfigStore::Http(u) => elastic::get_version(u, v, deadline).await,
            ConfigStore::Etcd(e) => {
                let (kvs, _) = e.etcd.range(&e.version_key(v), false, deadline).await?;
                kvs.first().map(config_of).transpose()
            }
        }
    }

    /// Changes the config: `size N`, or a whole config whose version is
    /// the next one. The built-in server wants the job's credential
    /// (`secret`); etcd has its own access control.
    pub async fn put(
        &self,
        body: &str,
        secret: Option<&JobSecret>,
        deadline: Instant,
    ) -> Result<ClusterConfig, PutError> {
        match self {
            ConfigStore::Http(u) => elastic::put_config(u, body, secret, deadline)
                .await
                .map_err(|e| match e.contains(": 409 ") {
                    true => PutError::Conflict(e),
                    false => PutError::Failed(e),
                }),
            ConfigStore::Etcd(e) => e.put(body, deadline).await,
        }
    }

    /// Every version after `after`, in order (see [`elastic::follow`]);
    /// a store unreachable for `give_up` ends it with the error.
    pub fn follow(
        &self,
        after: u32,
        period: Duration,
        give_up: Duration,
    ) -> mpsc::UnboundedReceiver<Result<ClusterConfig, String>> {
        match self {
            ConfigStore::Http(u) => elastic::follow(u.clone(), after, period, give_up),
            ConfigStore::Etcd(e) => e.clone().follow(after, period, give_up),
        }
    }
}

fn config_of(kv: &Kv) -> Result<ClusterConfig, String> {
    let text = std::str::from_utf8(&kv.value).map_err(|_| format!("{}: not UTF-8", kv.key))?;
    ClusterConfig::parse(text).map_err(|e| format!("{}: {e}", kv.key))
}

/// What a change reads, at one revision.
struct Read {
    config: ClusterConfig,
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

    fn version_key(&self, v: u32) -> String {
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

    async fn read(&self, deadline: Instant) -> Result<Read, String> {
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

    async fn put(&self, body: &str, deadline: Instant) -> Result<ClusterConfig, PutError> {
        let failed = PutError::Failed;
        loop {
            let mut r = self.read(deadline).await.map_err(failed)?;
            let rules = r
                .rules
                .clone()
                .ok_or_else(|| failed(format!("{}: no rules for changes", self.prefix)))?;
            let (next_version, change) = parse_change(body, r.config.version, rules.max_size)?;
            let peers = match change {
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
            let t = self
                .etcd
                .txn(
                    vec![same_mod(&self.key("config"), r.config_rev)],
                    ops,
                    vec![],
                    deadline,
                )
                .await
                .map_err(|e| failed(format!("the change may or may not have been made: {e}")))?;
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

    fn follow(
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
        let id = self.etcd.grant(MEMBER_TTL_S, deadline).await?;
        let key = self.key(&format!("members/{member}"));
        self.etcd
            .txn(vec![], vec![put_op(&key, value, id)], vec![], deadline)
            .await?;
        let etcd = self.etcd.clone();
        let every = Duration::from_millis(MEMBER_TTL_S as u64 * 1000 / 3);
        let value = value.to_string();
        // the lease in use, which a renewal after an expiry replaces
        let lease = Arc::new(AtomicI64::new(id));
        let current = lease.clone();
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
                    let put = vec![put_op(&key, &value, id)];
                    written = etcd.txn(vec![], put, vec![], soon).await.is_ok();
                }
            }
        });
        Ok(Membership {
            etcd: self.etcd.clone(),
            lease,
            task,
        })
    }

    /// Sets the state of the launcher of `host` in per-node mode
    /// (`P/launchers/HOST`; see `kungfu-run`'s `config_store`).
    pub async fn set_launcher(
        &self,
        host: &str,
        state: &str,
        deadline: Instant,
    ) -> Result<(), String> {
        let key = self.key(&format!("launchers/{host}"));
        self.etcd
            .txn(vec![], vec![put_op(&key, state, 0)], vec![], deadline)
            .await
            .map(|_| ())
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
    lease: Arc<AtomicI64>,
    task: tokio::task::JoinHandle<()>,
}

impl Membership {
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

    #[test]
    fn urls_rules_and_placement() {
        assert!(matches!(
            ConfigStore::open("http://a:1/cluster"),
            Ok(ConfigStore::Http(_))
        ));
        let s = ConfigStore::open("etcd://127.0.0.1:2379/kungfu/ab/").unwrap();
        assert_eq!(s.url(), "etcd://127.0.0.1:2379/kungfu/ab");
        for bad in ["etcd://127.0.0.1:2379", "etcd:///x", "ftp://a/b"] {
            assert!(ConfigStore::open(bad).is_err(), "{bad}");
        }
        let rules = Placement {
            max_size: 5,
            hosts: vec![("a".into(), 2), ("b".into(), 2), ("c".into(), 1)],
            bounded: true,
            port_base: 100,
        };
        assert_eq!(Placement::parse(&rules.encode()).unwrap(), rules);
        assert!(Placement::parse("max 1\n").is_err());
        assert!(Placement::parse("hosts a=x\nmax 1").is_err());
        let cur: PeerList = "a:100,b:100".parse().unwrap();
        let mut ports = vec![("a".to_string(), 100), ("b".to_string(), 100)];
        let grown = rules.resize(&cur, 5, &mut ports).unwrap();
        let grown: Vec<String> = grown.iter().map(|p| p.to_string()).collect();
        assert_eq!(grown, ["a:100", "b:100", "a:101", "b:101", "c:100"]);
        assert!(rules
            .resize(&cur, 6, &mut ports)
            .unwrap_err()
            .contains("1..=5"));
        assert_eq!(parse_ports(&encode_ports(&ports)).unwrap(), ports);
        // a port once given is not given again: a shrink and a regrow
        // take the next ones
        let again = rules
            .resize(&"a:100".parse().unwrap(), 2, &mut ports)
            .unwrap();
        assert_eq!(again[1].to_string(), "a:102");
        assert!(parse_ports("a x").is_err());
    }
}
