//! The config server and its client over loopback: requests served and
//! refused, and watchers that see every version or lose the server.

use std::time::Duration;

use kungfu_topology::Peer;
use kungfu_transport::auth::JobSecret;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use super::*;

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(5)
}

/// Up to `max_size` peers on 127.0.0.1, new ones from port 2000.
fn rules(max_size: usize, job: Option<&JobSecret>) -> ServerRules {
    let next_port = std::sync::atomic::AtomicU16::new(2000);
    ServerRules {
        max_size,
        hosts: Some(vec!["127.0.0.1".into()]),
        new_peer: Box::new(move |_| {
            Ok(Peer {
                host: "127.0.0.1".into(),
                port: next_port.fetch_add(1, std::sync::atomic::Ordering::SeqCst),
            })
        }),
        credential: job.cloned(),
        tls: false,
    }
}

#[tokio::test]
async fn serves_gets_and_puts_and_refuses_bad_ones() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let job = JobSecret::new(b"s3cret").unwrap();
    let initial = ClusterConfig {
        version: 0,
        peers: "127.0.0.1:1000,127.0.0.1:1001".parse().unwrap(),
    };
    let server = ConfigServer::start(l, initial.clone(), rules(4, Some(&job))).unwrap();
    let url = server.url();
    let mut rx = server.subscribe();
    assert_eq!(get_config(&url, Some(&job), soon()).await.unwrap(), initial);
    // reads and changes need the job's credential: 401 without, 403 with
    // another
    let e = get_config(&url, None, soon()).await.unwrap_err();
    assert!(e.contains("401"), "{e}");
    let e = put_config(&url, "size 3", None, soon()).await.unwrap_err();
    assert!(e.contains("401"), "{e}");
    let other = JobSecret::new(b"guess").unwrap();
    let e = get_config(&url, Some(&other), soon()).await.unwrap_err();
    assert!(e.contains("403 bad credential"), "{e}");
    let e = put_config(&url, "size 3", Some(&other), soon())
        .await
        .unwrap_err();
    assert!(e.contains("403 bad credential"), "{e}");
    assert!(!rx.has_changed().unwrap(), "refused: nothing changed");
    let put = |body: &'static str| put_config(&url, body, Some(&job), soon());

    let c = put("size 3").await.unwrap();
    assert_eq!(c.version, 1);
    assert_eq!(
        c.peers.to_string(),
        "127.0.0.1:1000,127.0.0.1:1001,127.0.0.1:2000"
    );
    assert!(rx.has_changed().unwrap());
    assert_eq!(*rx.borrow_and_update(), c);

    let c = put("size 1").await.unwrap();
    assert_eq!(
        (c.version, c.peers.to_string()),
        (2, "127.0.0.1:1000".into())
    );
    // the size it has already: no new version
    assert_eq!(put("size 1").await.unwrap(), c);

    let whole = "version 3\npeers 127.0.0.1:7,127.0.0.1:8\n";
    assert_eq!(put(whole).await.unwrap().version, 3);
    // a stale writer loses
    let e = put(whole).await.unwrap_err();
    assert!(e.contains("409"), "{e}");
    for bad in [
        "size 0",
        "size 5",
        "size x",
        "version 4\npeers 10.0.0.1:7\n",
        "version 4\npeers 127.0.0.1:7,127.0.0.1:7,127.0.0.1:7,127.0.0.1:7,127.0.0.1:7\n",
        "version 4\n",
        "hello",
    ] {
        let e = put(bad).await.unwrap_err();
        assert!(e.contains("400"), "{bad:?}: {e}");
    }
    assert_eq!(
        get_config(&url, Some(&job), soon()).await.unwrap().version,
        3
    );
    let (code, _) = request("POST", &url, "", Some(&job), soon()).await.unwrap();
    assert_eq!(code, 405);
    let (code, _) = request(
        "GET",
        &url.replace("/cluster", "/x"),
        "",
        Some(&job),
        soon(),
    )
    .await
    .unwrap();
    assert_eq!(code, 404);
    // garbage and silence get an answer or a closed connection, not a hang
    let mut s = TcpStream::connect(server.addr).await.unwrap();
    s.write_all(&[0xff; 9000]).await.unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out).await;
    assert!(out.starts_with("HTTP/1.1 400"), "{out}");
    assert!(get_config("ftp://x/cluster", None, soon()).await.is_err());
}

/// A launcher of another host sees every version in order, also those
/// made between two of its polls, and a server that stops answering
/// ends its watch with an error, in bounded time.
#[tokio::test]
async fn followers_see_every_version_and_a_lost_server() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let initial = ClusterConfig {
        version: 0,
        peers: "127.0.0.1:1000".parse().unwrap(),
    };
    let server = ConfigServer::start(l, initial, rules(8, None)).unwrap();
    let url = server.url();
    let mut local = server.versions(0);
    let mut remote = follow(
        url.clone(),
        None,
        0,
        Duration::from_millis(300),
        Duration::from_secs(1),
    );
    // three versions at once, well within one poll
    for n in [3, 2, 5] {
        put_config(&url, &format!("size {n}"), None, soon())
            .await
            .unwrap();
    }
    for rx in [&mut local, &mut remote] {
        for (v, n) in [(1, 3), (2, 2), (3, 5)] {
            let c = tokio::time::timeout(Duration::from_secs(5), rx.recv())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            assert_eq!((c.version, c.peers.len()), (v, n));
        }
    }
    // a peer outside the hosts served is refused
    let e = put_config(&url, "version 4\npeers 10.0.0.1:1", None, soon())
        .await
        .unwrap_err();
    assert!(e.contains("is not on a host of the job (127.0.0.1)"), "{e}");
    drop(server);
    let last = tokio::time::timeout(Duration::from_secs(10), remote.recv())
        .await
        .expect("the follower gives up in bounded time")
        .unwrap();
    assert!(last.unwrap_err().contains("unreachable"));
    assert!(local.recv().await.is_none(), "ends with the server");
}

/// Sends `raw` as one request to `addr`; the response as text.
async fn raw_request(addr: std::net::SocketAddr, raw: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(raw).await.unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out).await;
    out
}

/// What one on the path can record is worth nothing: a signed request sent
/// again is refused (and changes nothing), a request's signature does not
/// sign another, and a client takes no answer the server did not sign.
#[tokio::test]
async fn a_recorded_request_or_answer_is_refused() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let job = JobSecret::new(b"s3cret").unwrap();
    let initial = ClusterConfig {
        version: 0,
        peers: "127.0.0.1:1000,127.0.0.1:1001".parse().unwrap(),
    };
    let server = ConfigServer::start(l, initial, rules(4, Some(&job))).unwrap();
    let signed = |method: &str, body: &str| {
        let s = credential::sign(
            &job,
            method,
            "/cluster",
            body.as_bytes(),
            credential::now_ms(),
        )
        .unwrap();
        format!(
            "{method} /cluster HTTP/1.1\r\nAuthorization: {}\r\nContent-Length: {}\r\n\r\n{body}",
            s.authorization,
            body.len()
        )
    };
    let put = signed("PUT", "size 3");
    let first = raw_request(server.addr, put.as_bytes()).await;
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    assert!(first.contains("X-KungFu-Signature: "), "{first}");
    let again = raw_request(server.addr, put.as_bytes()).await;
    assert!(
        again.starts_with("HTTP/1.1 403") && again.contains("replayed"),
        "{again}"
    );
    // a GET's credential on a PUT (the same time and nonce)
    let get = signed("GET", "");
    let auth = get.lines().nth(1).unwrap();
    let forged = format!("PUT /cluster HTTP/1.1\r\n{auth}\r\nContent-Length: 6\r\n\r\nsize 1");
    let out = raw_request(server.addr, forged.as_bytes()).await;
    assert!(out.starts_with("HTTP/1.1 403"), "{out}");
    let c = get_config(&server.url(), Some(&job), soon()).await.unwrap();
    assert_eq!((c.version, c.peers.len()), (1, 3), "one change only");

    // a stranger answers in the server's name: unsigned, or signed with
    // nonsense; a 409 must not read as a conflict
    for (code, sig) in [(200, None), (200, Some("0".repeat(64))), (409, None)] {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let stranger = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let _ = read_request_for_test(&mut s).await;
            let body = "version 9\npeers 127.0.0.1:1\n";
            let sig = sig.map_or(String::new(), |s| format!("X-KungFu-Signature: {s}\r\n"));
            let head = format!(
                "HTTP/1.1 {code} X\r\n{sig}Content-Length: {}\r\n\r\n",
                body.len()
            );
            s.write_all(format!("{head}{body}").as_bytes())
                .await
                .unwrap();
        });
        let url = format!("http://{addr}/cluster");
        let e = if code == 409 {
            put_config(&url, "size 2", Some(&job), soon())
                .await
                .unwrap_err()
        } else {
            get_config(&url, Some(&job), soon()).await.unwrap_err()
        };
        assert!(
            e.contains("an answer refused") && !e.contains(": 409 "),
            "{code}: {e}"
        );
        stranger.await.unwrap();
    }
}

/// Reads a request off `s` (a stranger's side of the test above).
async fn read_request_for_test(s: &mut TcpStream) -> Result<(), String> {
    super::message::read_request(s).await.map(|_| ())
}

/// Across hosts the server speaks TLS with a certificate of the job's CA:
/// a client with the secret is served over `https://`; one with another
/// secret refuses the server at TLS (it is not its job's), one with none
/// cannot trust it; plain HTTP to the port gets no answer in clear; and a
/// TLS server needs the secret to exist at all.
#[tokio::test]
async fn across_hosts_the_server_speaks_tls_trusted_through_the_secret() {
    let job = JobSecret::new(b"s3cret").unwrap();
    let initial = ClusterConfig {
        version: 0,
        peers: "127.0.0.1:1000,127.0.0.1:1001".parse().unwrap(),
    };
    let mut r = rules(4, Some(&job));
    r.tls = true;
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = ConfigServer::start(l, initial.clone(), r).unwrap();
    let url = server.url();
    assert!(url.starts_with("https://127.0.0.1:"), "{url}");
    let c = put_config(&url, "size 3", Some(&job), soon())
        .await
        .unwrap();
    assert_eq!((c.version, c.peers.len()), (1, 3));
    assert_eq!(
        get_version(&url, 1, Some(&job), soon()).await.unwrap(),
        Some(c)
    );

    let other = JobSecret::new(b"another").unwrap();
    let e = get_config(&url, Some(&other), soon()).await.unwrap_err();
    assert!(e.contains("TLS with") && e.contains("not the job's"), "{e}");
    let e = get_config(&url, None, soon()).await.unwrap_err();
    assert!(e.contains("KUNGFU_JOB_SECRET"), "{e}");
    let plain = raw_request(server.addr, b"GET /cluster HTTP/1.1\r\n\r\n").await;
    assert!(
        !plain.contains("HTTP/1.1") && !plain.contains("peers"),
        "{plain}"
    );
    // the same server's URL as plain HTTP does not reach it either
    let e = get_config(&url.replace("https://", "http://"), Some(&job), soon())
        .await
        .unwrap_err();
    assert!(!e.contains("peers"), "{e}");
    assert_eq!(
        get_config(&url, Some(&job), soon()).await.unwrap().version,
        1,
        "nothing changed"
    );

    let mut r = rules(4, None);
    r.tls = true;
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let e = ConfigServer::start(l, initial, r).err().expect("refused");
    assert!(e.to_string().contains("needs the job's secret"), "{e}");
}
