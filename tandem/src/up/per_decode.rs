//! Decode-worker settings a fleet may vary across its workers (`--kv-load-failure-policy`,
//! `--reservation-ttl-ms`): one value for every decode worker, or a comma-separated list with
//! one each, as a fleet trying a setting on part of it runs.

use anyhow::bail;

/// A decode worker setting, in worker order, from `tandem up`'s `flag`: one value for all,
/// or a comma-separated list with one per decode worker; `parse` checks each.
fn per_decode<T: Clone>(
    flag: &str,
    given: &str,
    decode: usize,
    parse: impl Fn(&str) -> Result<T, String>,
) -> anyhow::Result<Vec<T>> {
    let list = given
        .split(',')
        .map(|v| parse(v.trim()).map_err(|why| anyhow::anyhow!("{flag} {given:?}: {why}")))
        .collect::<anyhow::Result<Vec<T>>>()?;
    match list.len() {
        1 => Ok(vec![list[0].clone(); decode]),
        n if n == decode => Ok(list),
        n => bail!("{flag} {given:?} lists {n} values for {decode} decode workers: give one, or one each"),
    }
}

/// Each decode worker's `--kv-load-failure-policy` ([`per_decode`]).
pub(super) fn decode_policies(given: &str, decode: usize) -> anyhow::Result<Vec<String>> {
    per_decode("--kv-load-failure-policy", given, decode, |p| match p {
        "recompute" | "retry" | "fail" => Ok(p.to_owned()),
        _ => Err(format!("{p:?} is none of recompute, retry, fail")),
    })
}

/// Each decode worker's `--reservation-ttl-ms` ([`per_decode`]).
pub(super) fn decode_leases(given: &str, decode: usize) -> anyhow::Result<Vec<u64>> {
    per_decode("--reservation-ttl-ms", given, decode, |ms| match ms.parse::<u64>() {
        Ok(0) | Err(_) => Err(format!("{ms:?} is no whole number of milliseconds above 0")),
        Ok(ms) => Ok(ms),
    })
}

#[cfg(test)]
mod tests {
    use super::{decode_leases, decode_policies};

    #[test]
    fn one_policy_for_all_or_one_per_decode_worker() {
        assert_eq!(decode_policies("retry", 3).unwrap(), ["retry", "retry", "retry"]);
        assert_eq!(decode_policies("recompute, retry", 2).unwrap(), ["recompute", "retry"]);
        let e = decode_policies("recompute,retry", 3).unwrap_err().to_string();
        assert!(e.contains("lists 2 values for 3 decode workers"), "{e}");
        assert_eq!(decode_leases("3000,30000", 2).unwrap(), [3000, 30000]);
        assert_eq!(decode_leases("5000", 2).unwrap(), [5000, 5000]);
        let e = decode_leases("3000,0", 2).unwrap_err().to_string();
        assert!(e.contains("--reservation-ttl-ms \"3000,0\": \"0\" is no whole number"), "{e}");
        let e = decode_policies("recompute,again", 2).unwrap_err().to_string();
        assert!(e.contains("\"again\" is none of recompute, retry, fail"), "{e}");
    }
}
