//! Elastic jobs: resizing with the model kept, and watch mode.

use super::*;

/// `kungfu-run -w`: a training loop that resizes 2 -> 4 -> 3 -> 1 -> 3.
/// New workers are started by the launcher and learn the step and the
/// model; removed workers are told they are detached and exit cleanly;
/// the model is checked on every worker at every step and after each
/// change; the resize latency is printed.
#[test]
fn elastic_job_resizes_2_4_3_1_3_and_keeps_the_model() {
    // shared memory (auto on one host) and TCP (every version accepts on
    // the socket the launcher passed down, which the worker keeps)
    for transport in ["auto", "tcp"] {
        elastic_job(transport);
    }
}

fn elastic_job(transport: &str) {
    let out = run_bounded(
        kungfu_run(&[
            "-w",
            "-np",
            "2",
            "--transport",
            transport,
            BENCH,
            "resize",
            "--sizes",
            "4,3,1,3",
            "-n",
            "4",
            "-b",
            "64K",
        ]),
        Duration::from_secs(120),
    );
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert_resized_2_4_3_1_3(&t);
}

/// Watch mode stops the workers a new version leaves out if they do not
/// exit by themselves (here: shell workers that never resize), without
/// failing the job; the resize is `kungfu-run --resize`'s, signed with
/// the job's secret.
#[test]
fn watch_mode_stops_removed_workers_that_stay() {
    let dir = TempDir::new("watch-stop");
    // Rank 0 stays until the launcher has stopped the other two: had it
    // exited first, version 1 (rank 0 alone) would be started afresh.
    let script = r#"
if [ "$KUNGFU_RANK" = 0 ] && [ "$KUNGFU_CLUSTER_VERSION" = 0 ]; then
  "$KFRUN" --resize 1 --config-server "$KUNGFU_CONFIG_SERVER" | head -1
  for i in $(seq 600); do
    gone=0
    for r in 1 2; do
      [ -s "$DIR/$r.pid" ] && ! kill -0 "$(cat "$DIR/$r.pid")" 2>/dev/null && gone=$((gone + 1))
    done
    [ "$gone" = 2 ] && { echo "ranks 1 and 2 are gone"; exit 0; }
    sleep 0.05
  done
  echo "ranks 1 and 2 are still running"; exit 1
else
  echo $$ > "$DIR/$KUNGFU_RANK.pid.tmp" && mv "$DIR/$KUNGFU_RANK.pid.tmp" "$DIR/$KUNGFU_RANK.pid"
  exec sleep 60
fi
"#;
    let dir_var = format!("DIR={}", dir.0.display());
    let out = run_bounded(
        kungfu_run(&[
            "-w",
            "-np",
            "3",
            "--detach-timeout",
            "300ms",
            "-x",
            &format!("KFRUN={RUN}"),
            "-x",
            &dir_var,
            "bash",
            "-c",
            script,
        ]),
        Duration::from_secs(60),
    );
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("[0] version 1"), "{t}");
    assert!(t.contains("[0] ranks 1 and 2 are gone"), "{t}");
    assert!(
        t.contains("kungfu-run: cluster version 1: 1 workers"),
        "{t}"
    );
    for r in [1, 2] {
        assert!(
            t.contains(&format!(
                "rank {r} left the cluster 300ms ago and is still running; stopping it"
            )),
            "{t}"
        );
    }
}

/// A worker that watch mode starts for a new version gets its listening
/// socket from the launcher, as the first ones do: an inherited socket
/// listening at its own port (checked against /proc/net/tcp).
#[test]
fn watch_mode_passes_new_workers_their_sockets() {
    let dir = TempDir::new("watch-grow");
    let script = r#"
if [ "$KUNGFU_CLUSTER_VERSION" = 0 ]; then
  "$KFRUN" --resize 2 --config-server "$KUNGFU_CONFIG_SERVER" | head -1
  # stay until the new worker is done (else version 1 restarts rank 0)
  for i in $(seq 1200); do
    [ -e "$DIR/done" ] && exit 0
    sleep 0.05
  done
  echo "the new worker never finished"; exit 1
fi
fd=${KUNGFU_LISTEN_FD:?no KUNGFU_LISTEN_FD}
ino=$(readlink "/proc/self/fd/$fd"); ino=${ino#socket:[}; ino=${ino%]}
port=$(printf '%04X' "${KUNGFU_PEERS##*:}")
if awk -v p=":$port" -v i="$ino" '$2 ~ p"$" && $4 == "0A" && $10 == i { f = 1 } END { exit !f }' /proc/net/tcp; then
  echo "version $KUNGFU_CLUSTER_VERSION: fd $fd listens at my port"
else
  echo "version $KUNGFU_CLUSTER_VERSION: fd $fd ($ino) is not the socket of port $port"
fi
touch "$DIR/done"
"#;
    let dir_var = format!("DIR={}", dir.0.display());
    let out = run_bounded(
        kungfu_run(&[
            "-w",
            "-np",
            "1",
            "-x",
            &format!("KFRUN={RUN}"),
            "-x",
            &dir_var,
            "bash",
            "-c",
            script,
        ]),
        Duration::from_secs(60),
    );
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("[0] version 1"), "{t}");
    assert!(
        t.contains("kungfu-run: cluster version 1: 2 workers"),
        "{t}"
    );
    assert!(
        t.contains("] version 1: fd ") && t.contains(" listens at my port"),
        "{t}"
    );
}
