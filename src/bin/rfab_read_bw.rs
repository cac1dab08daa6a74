//! `rfab_read_bw`: RDMA read bandwidth through rverbs' `fi_read`, printed as perftest's `ib_read_bw` does.

mod common;

fn main() -> std::process::ExitCode {
    common::main(common::Test::ReadBw)
}
