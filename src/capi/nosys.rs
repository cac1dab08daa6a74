//! Operations rverbs does not offer yet (RMA, tagged, atomics, collectives, …): every slot of
//! their ops tables answers `-FI_ENOSYS`, because libfabric's inline wrappers call through
//! these tables without checking for NULL. One generic function per arity fits any slot.

use rfabric_sys::fabric as fi;

use crate::core::error::errno;

const ENOSYS: isize = -(errno::ENOSYS as isize);

macro_rules! nosys_fns {
    ($($name:ident $name_i:ident ($($t:ident),*);)*) => {$(
        #[allow(clippy::too_many_arguments)]
        pub(crate) unsafe extern "C" fn $name<$($t),*>($(_: $t),*) -> isize {
            ENOSYS
        }
        #[allow(clippy::too_many_arguments, dead_code)]
        pub(crate) unsafe extern "C" fn $name_i<$($t),*>($(_: $t),*) -> i32 {
            ENOSYS as i32
        }
    )*};
}

nosys_fns! {
    n1 n1i (A);
    n2 n2i (A, B);
    n3 n3i (A, B, C);
    n4 n4i (A, B, C, D);
    n5 n5i (A, B, C, D, E);
    n6 n6i (A, B, C, D, E, F);
    n7 n7i (A, B, C, D, E, F, G);
    n8 n8i (A, B, C, D, E, F, G, H);
    n9 n9i (A, B, C, D, E, F, G, H, I);
    n10 n10i (A, B, C, D, E, F, G, H, I, J);
    n11 n11i (A, B, C, D, E, F, G, H, I, J, K);
    n12 n12i (A, B, C, D, E, F, G, H, I, J, K, L);
    n13 n13i (A, B, C, D, E, F, G, H, I, J, K, L, M);
    n14 n14i (A, B, C, D, E, F, G, H, I, J, K, L, M, N);
    n16 n16i (A, B, C, D, E, F, G, H, I, J, K, L, M, N, O, P);
}

/// `fi_ops_rma`: RMA is a later issue.
pub(crate) static RMA: fi::fi_ops_rma = fi::fi_ops_rma {
    size: std::mem::size_of::<fi::fi_ops_rma>(),
    read: Some(n8),
    readv: Some(n8),
    readmsg: Some(n3),
    write: Some(n8),
    writev: Some(n8),
    writemsg: Some(n3),
    inject: Some(n6),
    writedata: Some(n9),
    injectdata: Some(n7),
};

/// `fi_ops_tagged`: rverbs endpoints have no tag matching (`FI_TAGGED` is never offered).
pub(crate) static TAGGED: fi::fi_ops_tagged = fi::fi_ops_tagged {
    size: std::mem::size_of::<fi::fi_ops_tagged>(),
    recv: Some(n8),
    recvv: Some(n8),
    recvmsg: Some(n3),
    send: Some(n7),
    sendv: Some(n7),
    sendmsg: Some(n3),
    inject: Some(n5),
    senddata: Some(n8),
    injectdata: Some(n6),
};

/// `fi_ops_atomic`: no atomics.
pub(crate) static ATOMIC: fi::fi_ops_atomic = fi::fi_ops_atomic {
    size: std::mem::size_of::<fi::fi_ops_atomic>(),
    write: Some(n10),
    writev: Some(n10),
    writemsg: Some(n3),
    inject: Some(n8),
    readwrite: Some(n12),
    readwritev: Some(n13),
    readwritemsg: Some(n6),
    compwrite: Some(n14),
    compwritev: Some(n16),
    compwritemsg: Some(n9),
    writevalid: Some(n4i),
    readwritevalid: Some(n4i),
    compwritevalid: Some(n4i),
};

/// `fi_ops_collective`: no collectives.
pub(crate) static COLLECTIVE: fi::fi_ops_collective = fi::fi_ops_collective {
    size: std::mem::size_of::<fi::fi_ops_collective>(),
    barrier: Some(n3),
    broadcast: Some(n9),
    alltoall: Some(n10),
    allreduce: Some(n11),
    allgather: Some(n10),
    reduce_scatter: Some(n11),
    reduce: Some(n12),
    scatter: Some(n11),
    gather: Some(n11),
    msg: Some(n6),
    barrier2: Some(n4),
};
