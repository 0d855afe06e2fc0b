//! Waiting on the lanes: the door bells a peer rings when it publishes to
//! this rank or releases one of its contributions (see [`super::super::bell`]),
//! and a thread armed to sleep on all of them.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use super::super::bell::{self, Waiter};
use super::{HostLanes, OFF_ACK_BELL, OFF_BELL, OFF_RX_SLEEPERS, OFF_TX_SLEEPERS};

impl HostLanes {
    /// Every bell this rank waits on, with its sleepers' count: the data
    /// bells of its inbound lanes, the release bells of its outbound ones.
    fn bell_words(&self) -> impl Iterator<Item = (&AtomicU32, &AtomicU32)> {
        self.bells.iter().enumerate().map(move |(i, l)| {
            if i < self.inbound {
                (l.u32_at(OFF_BELL), l.u32_at(OFF_RX_SLEEPERS))
            } else {
                (l.u32_at(OFF_ACK_BELL), l.u32_at(OFF_TX_SLEEPERS))
            }
        })
    }

    /// A count that moves whenever a peer publishes a contribution to this
    /// rank or releases one of this rank's: compare two reads to learn
    /// whether anything happened between them.
    pub fn activity(&self) -> u32 {
        self.bell_words()
            .fold(0u32, |a, (b, _)| a.wrapping_add(b.load(Ordering::SeqCst)))
    }

    /// Counts this thread a sleeper on every bell and reads them. Then
    /// look at the lanes once more, and sleep ([`Armed::sleep`]) only if
    /// nothing is there: whatever a peer does after that look wakes the
    /// sleep (see [`super::super::bell`]).
    pub fn arm(&self) -> Armed<'_> {
        let values = self
            .bell_words()
            .map(|(b, sleepers)| {
                bell::arm(sleepers);
                b.load(Ordering::SeqCst)
            })
            .collect();
        Armed {
            lanes: self,
            values,
        }
    }
}

/// This thread, counted a sleeper on every bell of a [`HostLanes`] (until
/// dropped), and the bells' counts when it was armed.
pub struct Armed<'a> {
    lanes: &'a HostLanes,
    values: Vec<u32>,
}

impl Armed<'_> {
    /// Sleeps until a peer publishes to this rank or releases one of its
    /// contributions after [`HostLanes::arm`], `local` (a word of this
    /// process) leaves its value, or `timeout` passes.
    pub fn sleep(&self, local: Option<Waiter<'_>>, timeout: Duration) {
        let waiters: Vec<Waiter<'_>> = self
            .lanes
            .bell_words()
            .zip(&self.values)
            .map(|((word, _), &value)| Waiter {
                word,
                value,
                shared: true,
            })
            .chain(local)
            .collect();
        bell::wait_any(&waiters, timeout);
    }
}

impl Drop for Armed<'_> {
    fn drop(&mut self) {
        for (_, sleepers) in self.lanes.bell_words() {
            bell::disarm(sleepers);
        }
    }
}
