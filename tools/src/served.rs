//! The built-in config server of an elastic job (`kungfu-run -w`,
//! `--on-failure shrink|replace`; `kungfu::elastic`): where it listens,
//! where `size N` puts new workers, and the sockets it binds for them.

use std::collections::{HashMap, HashSet};

use anyhow::Context;
use kungfu::elastic::{ClusterConfig, ConfigServer, ServerRules};
use kungfu_topology::{Peer, PeerList};
use kungfu_transport::auth::JobSecret;

use crate::bind_listener;
use crate::options::LaunchOptions;

/// Sockets bound for the workers a watched job has not started yet, by
/// address.
pub type Pending = std::sync::Arc<std::sync::Mutex<HashMap<String, std::net::TcpListener>>>;

/// Takes the socket bound for a new worker at `addr`, or binds `addr` (a
/// whole config PUT may name any address): either way the worker gets its
/// socket from the launcher, as the first ones did.
pub fn listener_for(pending: &Pending, p: &Peer) -> anyhow::Result<std::net::TcpListener> {
    let bound = pending
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&p.to_string());
    match bound {
        Some(l) => Ok(l),
        None => std::net::TcpListener::bind((p.host.as_str(), p.port))
            .with_context(|| format!("cannot listen on {p} for a new worker")),
    }
}

/// Starts the config server of a watched job, with the job's credential
/// wanted for every change (see `kungfu::elastic`).
///
/// On one machine (`all_local`) it listens on the loopback, and a new peer
/// goes on the first host of `-H` with a port bound here and held until
/// its worker starts with it (see `pass_listener`). Across hosts it listens
/// on this host's address of `-H` (`here`), for the launchers and workers
/// of the other hosts; a new peer goes on the first host of `-H` with a
/// free slot, at the first port from `--port-base` the job has not used on
/// that host, which its launcher binds when it starts the worker.
pub async fn config_server(
    opts: &LaunchOptions,
    peers: &PeerList,
    secret: &JobSecret,
    here: Option<&str>,
) -> anyhow::Result<(ConfigServer, Pending)> {
    let listener = match here {
        None => tokio::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0)).await,
        Some(host) => tokio::net::TcpListener::bind((host, 0)).await,
    }
    .context("binding the config server")?;
    let used = std::sync::Mutex::new(
        peers
            .peers()
            .iter()
            .map(|p| (p.host.clone(), p.port))
            .collect::<HashSet<(String, u16)>>(),
    );
    let pending = Pending::default();
    let bound = pending.clone();
    let hosts = opts.hosts.clone();
    let across = here.is_some();
    let port_base = opts.port_base;
    let total: usize = hosts.iter().map(|h| h.slots).sum();
    let rules = ServerRules {
        // on one host the slots do not bound a watched job; across hosts
        // they say where new workers can go
        max_size: if across {
            opts.max_np.min(total)
        } else {
            opts.max_np
        },
        hosts: Some(hosts.iter().map(|h| h.host.clone()).collect()),
        // A port never used in this job, so that an address names one
        // worker only (the kernel may offer the port of one that exited).
        // The refused sockets stay bound until one is found, so the
        // kernel offers another port each time.
        new_peer: Box::new(move |so_far| {
            let mut used = used.lock().unwrap_or_else(|e| e.into_inner());
            let new_host = if across {
                let room = |h: &&crate::HostSlots| {
                    so_far.iter().filter(|p| p.host == h.host).count() < h.slots
                };
                let Some(h) = hosts.iter().find(room) else {
                    return Err(format!("all {total} slots of the job's hosts are taken"));
                };
                h.host.clone()
            } else {
                hosts[0].host.clone()
            };
            if across {
                for port in port_base..=u16::MAX {
                    if used.insert((new_host.clone(), port)) {
                        return Ok(Peer {
                            host: new_host,
                            port,
                        });
                    }
                }
                return Err(format!("no port left on {new_host}"));
            }
            let mut refused = Vec::new();
            for _ in 0..100 {
                let l = bind_listener(&new_host).map_err(|e| format!("{e:#}"))?;
                let port = l.local_addr().map_err(|e| e.to_string())?.port();
                if !used.insert((new_host.clone(), port)) {
                    refused.push(l);
                    continue;
                }
                let p = Peer {
                    host: new_host.clone(),
                    port,
                };
                bound
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(p.to_string(), l);
                return Ok(p);
            }
            Err("no free port".into())
        }),
        credential: Some(secret.clone()),
        // across hosts the server's address is routable: TLS, trusted
        // through the secret, hides the cluster's addresses and requests
        tls: across,
    };
    let initial = ClusterConfig {
        version: 0,
        peers: peers.clone(),
    };
    Ok((ConfigServer::start(listener, initial, rules)?, pending))
}
