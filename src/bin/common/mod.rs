//! What the perftest-style tools share: options, connection set-up through rverbs, the
//! ping-pong and windowed-send loops, and perftest's output tables.
#![allow(dead_code)]

mod loops;
mod oob;
mod options;
mod setup;
mod tables;

use loops::{run_bw, run_lat, run_read_lat, run_write_lat, sizes};
pub(crate) use options::Test;
use options::{parse, usage};
use setup::connect;
use tables::{banner, lat_stats, print_bw, print_lat};

/// Runs a tool: parses arguments, connects, runs every size, prints the table.
pub(crate) fn main(test: Test) -> std::process::ExitCode {
    use std::process::ExitCode;
    let mut o = match parse(test, std::env::args().skip(1)) {
        Ok(o) => o,
        Err(msg) => {
            if msg.is_empty() {
                print!("{}", usage(test));
                return ExitCode::SUCCESS;
            }
            eprint!("error: {msg}\n{}", usage(test));
            return ExitCode::from(2);
        }
    };
    let mut run = || -> Result<(), String> {
        let c = connect(&mut o)?;
        if c.is_server {
            eprintln!("client connected from {}", c.ep.names().1);
        }
        banner(&o, &c);
        for size in sizes(&o, &c) {
            match o.test {
                Test::SendLat => {
                    let mut s = run_lat(&c, size, o.iters, o.timeout)?;
                    if !c.is_server {
                        print_lat(&o, size, &lat_stats(&mut s));
                    }
                }
                Test::WriteLat | Test::ReadLat => {
                    let mut s = if o.test == Test::WriteLat {
                        run_write_lat(&c, size, o.iters, o.timeout)?
                    } else {
                        run_read_lat(&c, size, o.iters, o.timeout)?
                    };
                    if !c.is_server {
                        print_lat(&o, size, &lat_stats(&mut s));
                    }
                }
                Test::SendBw | Test::WriteBw | Test::ReadBw => {
                    let (secs, peak) = run_bw(&c, o.test, size, o.iters, o.tx_depth, o.timeout)?;
                    if !c.is_server {
                        print_bw(&o, size, secs, peak);
                    }
                }
            }
        }
        if !o.json {
            println!("{}", "-".repeat(87));
        }
        c.ep.shutdown().map_err(|e| e.to_string())?;
        Ok(())
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
