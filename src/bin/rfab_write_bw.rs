//! `rfab_write_bw`: RDMA write bandwidth through rverbs' `fi_write`, printed as perftest's `ib_write_bw` does.

mod common;

fn main() -> std::process::ExitCode {
    common::main(common::Test::WriteBw)
}
