//! Op names: their 64-bit ids, per-name sequence numbers, and detection of
//! two live names that share an id.

use std::collections::HashMap;
use std::sync::Arc;

use kungfu_topology::fnv1a64;
use kungfu_transport::OpId;

use crate::CollectiveError;

/// The longest op name accepted.
pub const MAX_NAME_LEN: usize = 4096;

/// The id of an op name (FNV-1a 64 of its bytes; the same on every build).
pub fn op_id(name: &str) -> OpId {
    OpId(fnv1a64(0xcbf2_9ce4_8422_2325, name.as_bytes()))
}

/// Tracks names. The sequence number of a name counts the ops of that name
/// issued before, so the k-th "grad/fc1" of one rank meets the k-th of every
/// other rank, even when a fast rank already issued the (k+1)-th.
///
/// Counters are kept per id for the life of the session (16 bytes per
/// distinct name); names themselves only while an op of theirs is live.
#[derive(Default)]
pub(crate) struct NameTable {
    next_seq: HashMap<OpId, u32>,
    live: HashMap<OpId, (Arc<str>, usize)>,
}

impl NameTable {
    /// Registers a new op of `name`; returns its id and sequence number.
    pub(crate) fn begin(&mut self, name: &Arc<str>) -> Result<(OpId, u32), CollectiveError> {
        self.begin_with_id(op_id(name), name)
    }

    pub(crate) fn begin_with_id(
        &mut self,
        id: OpId,
        name: &Arc<str>,
    ) -> Result<(OpId, u32), CollectiveError> {
        match self.live.get_mut(&id) {
            Some((other, _)) if **other != **name => {
                return Err(CollectiveError::NameCollision {
                    name: name.clone(),
                    other: other.clone(),
                    id: id.0,
                })
            }
            Some((_, live)) => *live += 1,
            None => {
                self.live.insert(id, (name.clone(), 1));
            }
        }
        let seq = self.next_seq.entry(id).or_insert(0);
        let s = *seq;
        *seq = seq.wrapping_add(1);
        Ok((id, s))
    }

    /// An op of `id` is over.
    pub(crate) fn end(&mut self, id: OpId) {
        if let Some((_, live)) = self.live.get_mut(&id) {
            *live -= 1;
            if *live == 0 {
                self.live.remove(&id);
            }
        }
    }
}

/// Checks a caller's op name.
pub(crate) fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("op names must not be empty".into());
    }
    if name.len() > MAX_NAME_LEN {
        return Err(format!(
            "op name of {} bytes; at most {MAX_NAME_LEN}",
            name.len()
        ));
    }
    if name.contains('\0') {
        return Err("op names must not contain NUL (reserved for internal ops)".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_numbers_count_per_name() {
        let mut t = NameTable::default();
        let a: Arc<str> = "a".into();
        let b: Arc<str> = "b".into();
        assert_eq!(t.begin(&a).unwrap().1, 0);
        assert_eq!(t.begin(&a).unwrap().1, 1); // same name twice in flight
        assert_eq!(t.begin(&b).unwrap().1, 0);
        t.end(op_id("a"));
        t.end(op_id("a"));
        assert_eq!(t.begin(&a).unwrap().1, 2);
    }

    #[test]
    fn live_collision_is_detected_and_clears() {
        let mut t = NameTable::default();
        let x: Arc<str> = "x".into();
        let y: Arc<str> = "y".into();
        let id = OpId(42);
        t.begin_with_id(id, &x).unwrap();
        match t.begin_with_id(id, &y) {
            Err(CollectiveError::NameCollision { name, other, id }) => {
                assert_eq!((&*name, &*other, id), ("y", "x", 42));
            }
            other => panic!("{other:?}"),
        }
        t.end(id);
        // once x is no longer live, y may use the id
        assert!(t.begin_with_id(id, &y).is_ok());
    }

    #[test]
    fn names_are_checked() {
        assert!(check_name("grad/fc1").is_ok());
        assert!(check_name("").is_err());
        assert!(check_name("a\0b").is_err());
        assert!(check_name(&"x".repeat(MAX_NAME_LEN + 1)).is_err());
    }
}
