//! Each launcher's variables, the tuning ones, the QUIC files and the
//! job secret, read from a stand-in for the environment.

use std::collections::HashMap;

use super::launcher::derived_port;
use super::*;

fn env(pairs: &[(&str, &str)]) -> Result<WorkerEnv, BootstrapError> {
    let m: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    WorkerEnv::from_vars(&move |k| m.get(k).cloned())
}

#[test]
fn transports_and_quic_files_are_checked() {
    let base = [
        ("KUNGFU_RANK", "0"),
        ("KUNGFU_SIZE", "1"),
        ("KUNGFU_PEERS", "127.0.0.1:5000"),
    ];
    let with = |extra: &[(&'static str, &'static str)]| {
        let mut v = base.to_vec();
        v.extend_from_slice(extra);
        env(&v)
    };
    let e = with(&[("KUNGFU_TRANSPORT", "quic")]).unwrap();
    assert_eq!((e.transport, e.quic_files), (TransportKind::Quic, None));
    let e = with(&[("KUNGFU_TRANSPORT", "udp")])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("KUNGFU_TRANSPORT") && e.contains("one of: auto"),
        "{e}"
    );
    let e = with(&[("KUNGFU_QUIC_CA", "/a"), ("KUNGFU_QUIC_KEY", "/c")]);
    let e = e.unwrap_err().to_string();
    assert!(
        e.contains("KUNGFU_QUIC_CERT") && e.contains("all three"),
        "{e}"
    );
    let all = [
        ("KUNGFU_QUIC_CA", "/a"),
        ("KUNGFU_QUIC_CERT", "/b"),
        ("KUNGFU_QUIC_KEY", "/c"),
    ];
    let f = with(&all).unwrap().quic_files.unwrap();
    assert_eq!(
        (f.ca, f.cert, f.key),
        ("/a".into(), "/b".into(), "/c".into())
    );
}

#[test]
fn kungfu_run_variables() {
    let e = env(&[
        ("KUNGFU_RANK", "1"),
        ("KUNGFU_SIZE", "2"),
        ("KUNGFU_PEERS", "127.0.0.1:5000,127.0.0.1:5001"),
        ("KUNGFU_STRATEGY", "ring"),
        ("KUNGFU_CLUSTER_ID", "0xabc"),
    ])
    .unwrap();
    assert_eq!((e.launcher, e.rank, e.size), (Launcher::KungfuRun, 1, 2));
    assert_eq!(e.strategy, Strategy::Ring);
    assert_eq!(e.cluster_id, Some(0xabc));
    assert_eq!(e.secret, None, "not set: nothing is authenticated");
    assert_eq!(e.auto, AutoThresholds::default());
    assert_eq!(e.spin, None);
    assert_eq!(e.listen_fd, None);
    assert_eq!(e.buffer_pool_bytes, 256 << 20);
    let base = [
        ("KUNGFU_RANK", "0"),
        ("KUNGFU_SIZE", "1"),
        ("KUNGFU_PEERS", "127.0.0.1:5000"),
    ];
    let tuned = [
        base.as_slice(),
        &[
            ("KUNGFU_AUTO_LARGE_BYTES", "4096"),
            ("KUNGFU_SPIN_US", "7"),
            ("KUNGFU_BUFFER_POOL_BYTES", "0"),
        ],
    ]
    .concat();
    let e = env(&tuned).unwrap();
    assert_eq!(e.auto.large_bytes, 4096);
    assert_eq!(e.buffer_pool_bytes, 0);
    let passed = [base.as_slice(), &[("KUNGFU_LISTEN_FD", "7")]].concat();
    assert_eq!(env(&passed).unwrap().listen_fd, Some(7));
    let bad = [base.as_slice(), &[("KUNGFU_LISTEN_FD", "seven")]].concat();
    assert!(env(&bad).is_err());
    assert_eq!(e.spin, Some(Duration::from_micros(7)));
    let bad = [base.as_slice(), &[("KUNGFU_AUTO_LARGE_BYTES", "big")]].concat();
    let err = env(&bad).unwrap_err().to_string();
    assert!(err.contains("KUNGFU_AUTO_LARGE_BYTES"), "{err}");
    assert!(env(&[
        ("KUNGFU_RANK", "1"),
        ("KUNGFU_SIZE", "3"),
        ("KUNGFU_PEERS", "a:1,a:2")
    ])
    .is_err());
}

#[test]
fn the_job_secret() {
    let base = [
        ("KUNGFU_RANK", "0"),
        ("KUNGFU_SIZE", "1"),
        ("KUNGFU_PEERS", "127.0.0.1:5000"),
    ];
    let with = |v: &str| env(&[base.as_slice(), &[("KUNGFU_JOB_SECRET", v)]].concat());
    let e = with("0123abcd").unwrap();
    assert_eq!(e.secret, Some(JobSecret::new(b"0123abcd").unwrap()));
    assert!(!format!("{e:?}").contains("0123abcd"), "never printed");
    assert_eq!(with("").unwrap().secret, None, "empty is unset");
    let long = "x".repeat(2000);
    let err = with(&long).unwrap_err().to_string();
    assert!(
        err.contains("KUNGFU_JOB_SECRET") && err.contains("at most"),
        "{err}"
    );
    // every launcher's workers read it
    let t = env(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "10.1.2.3"),
        ("MASTER_PORT", "29500"),
        ("KUNGFU_JOB_SECRET", "s"),
    ])
    .unwrap();
    assert!(t.secret.is_some());
}

#[test]
fn torchrun_variables() {
    let e = env(&[
        ("RANK", "3"),
        ("WORLD_SIZE", "4"),
        ("MASTER_ADDR", "10.1.2.3"),
        ("MASTER_PORT", "29500"),
    ])
    .unwrap();
    assert_eq!(e.launcher, Launcher::Torchrun);
    assert_eq!(
        e.discovery,
        Discovery::Rendezvous {
            host: "10.1.2.3".into(),
            port: 29501
        }
    );
    assert!(env(&[
        ("RANK", "4"),
        ("WORLD_SIZE", "4"),
        ("MASTER_ADDR", "h"),
        ("MASTER_PORT", "1")
    ])
    .is_err());
}

#[test]
fn slurm_and_mpi_variables() {
    let e = env(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_JOB_NODELIST", "gpu[07-09],x1"),
        ("SLURM_JOB_ID", "77"),
    ])
    .unwrap();
    match e.discovery {
        Discovery::Rendezvous { host, port } => {
            assert_eq!(host, "gpu07");
            assert_eq!(port, derived_port("77"));
        }
        d => panic!("{d:?}"),
    }
    let m = env(&[
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ("KUNGFU_RENDEZVOUS_PORT", "4444"),
    ])
    .unwrap();
    assert_eq!(
        m.discovery,
        Discovery::Rendezvous {
            host: "127.0.0.1".into(),
            port: 4444
        }
    );
    // across hosts, mpirun needs an explicit rendezvous
    assert!(env(&[
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    ])
    .is_err());
    let o = env(&[
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("KUNGFU_RENDEZVOUS", "h0:99"),
    ])
    .unwrap();
    assert_eq!(
        o.discovery,
        Discovery::Rendezvous {
            host: "h0".into(),
            port: 99
        }
    );
}

#[test]
fn nothing_set_is_a_single_worker() {
    let e = env(&[]).unwrap();
    assert_eq!((e.launcher, e.rank, e.size), (Launcher::Single, 0, 1));
    // at a port the kernel picks when it starts, on loopback unless told
    let Discovery::Peers(p) = &e.discovery else {
        panic!("{:?}", e.discovery)
    };
    assert_eq!(p.peers()[0].to_string(), "127.0.0.1:0");
    let e = env(&[("KUNGFU_SELF_HOST", "198.18.0.7")]).unwrap();
    let Discovery::Peers(p) = &e.discovery else {
        panic!("{:?}", e.discovery)
    };
    assert_eq!(p.peers()[0].to_string(), "198.18.0.7:0");
    assert!(env(&[("KUNGFU_SELF_HOST", "a,b")]).is_err());
    // alone whatever a launcher set
    let vars = [
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "h"),
        ("MASTER_PORT", "9"),
    ];
    assert_eq!(env(&vars).unwrap().launcher, Launcher::Torchrun);
    let e = env(&[vars.as_slice(), &[("KUNGFU_ALONE", "1")]].concat()).unwrap();
    assert_eq!((e.launcher, e.rank, e.size), (Launcher::Single, 0, 1));
    assert!(env(&[("KUNGFU_ALONE", "yes")]).is_err());
}

#[test]
fn slurm_node_lists() {
    assert_eq!(first_slurm_host("node1"), Some("node1".into()));
    assert_eq!(first_slurm_host("a[001-004,9],b2"), Some("a001".into()));
    assert_eq!(first_slurm_host("x[3],y"), Some("x3".into()));
    assert_eq!(first_slurm_host("bad[]"), None);
    assert_eq!(first_slurm_host(""), None);
}
