//! The C ABI's arguments, checked: its enums (`kf_dtype`, `kf_op`,
//! `kf_strategy`, `kf_transport`) to the library's types and back, names,
//! and roots. An unknown value is `KF_ERR_INVALID_ARGUMENT`, never a
//! panic.

use std::ffi::{c_char, c_int, CStr};

use kungfu_collectives::{DType, ReduceOp};
use kungfu_topology::{Rank, Strategy};

use crate::*;

pub(crate) fn transport_of(t: kf_transport) -> Res<kungfu_transport::any::TransportKind> {
    use kungfu_transport::any::TransportKind as K;
    Ok(match t {
        KF_TRANSPORT_AUTO => K::Auto,
        KF_TRANSPORT_TCP => K::Tcp,
        KF_TRANSPORT_SHM => K::Shm,
        KF_TRANSPORT_QUIC => K::Quic,
        KF_TRANSPORT_FABRIC => K::Fabric,
        KF_TRANSPORT_VERBS => K::Verbs,
        other => return Err(invalid(format!("unknown kf_transport {other}"))),
    })
}

pub(crate) fn transport_code(t: kungfu_transport::any::TransportKind) -> kf_transport {
    use kungfu_transport::any::TransportKind as K;
    match t {
        K::Auto => KF_TRANSPORT_AUTO,
        K::Tcp => KF_TRANSPORT_TCP,
        K::Shm => KF_TRANSPORT_SHM,
        K::Quic => KF_TRANSPORT_QUIC,
        K::Fabric => KF_TRANSPORT_FABRIC,
        K::Verbs => KF_TRANSPORT_VERBS,
    }
}

pub(crate) fn dtype_of(d: kf_dtype) -> Res<DType> {
    DType::ALL
        .into_iter()
        .find(|t| *t as i32 == d)
        .ok_or_else(|| invalid(format!("unknown kf_dtype {d}")))
}

pub(crate) fn op_of(o: kf_op) -> Res<ReduceOp> {
    Ok(match o {
        KF_SUM => ReduceOp::Sum,
        KF_MIN => ReduceOp::Min,
        KF_MAX => ReduceOp::Max,
        KF_PROD => ReduceOp::Prod,
        KF_AVG => ReduceOp::Avg,
        _ => return Err(invalid(format!("unknown kf_op {o}"))),
    })
}

pub(crate) fn strategy_of(s: kf_strategy) -> Res<Strategy> {
    Ok(match s {
        KF_STRATEGY_AUTO => Strategy::Auto,
        KF_STRATEGY_STAR => Strategy::Star,
        KF_STRATEGY_RING => Strategy::Ring,
        KF_STRATEGY_TREE => Strategy::Tree,
        KF_STRATEGY_BINARY_TREE => Strategy::BinaryTree,
        KF_STRATEGY_BINARY_TREE_STAR => Strategy::BinaryTreeStar,
        KF_STRATEGY_MULTI_BINARY_TREE_STAR => Strategy::MultiBinaryTreeStar,
        KF_STRATEGY_CLIQUE => Strategy::Clique,
        KF_STRATEGY_RECURSIVE_DOUBLING => Strategy::RecursiveDoubling,
        _ => return Err(invalid(format!("unknown kf_strategy {s}"))),
    })
}

pub(crate) fn name_of(name: *const c_char) -> Res<String> {
    if name.is_null() {
        return Err(invalid("name is NULL"));
    }
    // SAFETY: the caller passed a NUL-terminated string.
    let s = unsafe { CStr::from_ptr(name) };
    s.to_str()
        .map(str::to_owned)
        .map_err(|_| invalid("name is not UTF-8"))
}

pub(crate) fn root_of(root: c_int, n: usize) -> Res<Rank> {
    if root < 0 || root as usize >= n {
        return Err(invalid(format!("root {root} outside a cluster of {n}")));
    }
    Ok(Rank(root as u32))
}
