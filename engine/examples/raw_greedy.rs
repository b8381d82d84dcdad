//! Greedy-decodes from raw token ids (no tokenizer), printing ids and pieces; a debugging aid.
use engine::kv::{KvDtype, KvPool};
use engine::model::{Model, SeqChunk};
use engine::weights::Weights;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args().nth(1).ok_or("usage: raw_greedy MODEL ID...")?;
    let mut ids: Vec<u32> = std::env::args().skip(2).map(|s| s.parse()).collect::<Result<_, _>>()?;
    let (w, f) = Weights::from_gguf(std::path::Path::new(&path))?;
    let vocab = f.str_array("tokenizer.ggml.tokens")?;
    let threads = std::env::var("THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
    let mut m = Model::new(w, threads)?;
    let mut pool = KvPool::new(m.kv_layout(16, KvDtype::F16), 64)?;
    let table: Vec<u32> = pool.allocate(64)?;
    let t0 = std::time::Instant::now();
    let n_prompt = ids.len();
    let mut start = 0;
    for step in 0..24 {
        let chunk = SeqChunk { tokens: &ids[start..], start, table: &table, logits: true };
        let logits = m.forward(&mut pool, &[chunk])?;
        let (best, _) = logits.iter().enumerate().fold((0, f32::MIN), |a, (i, &v)| if v > a.1 { (i, v) } else { a });
        if step == 0 {
            eprintln!("prefill {} tokens: {:?}", n_prompt, t0.elapsed());
        }
        start = ids.len();
        ids.push(best as u32);
        print!("{}", vocab[best].replace('Ġ', " ").replace('Ċ', "\n"));
    }
    println!();
    eprintln!("total {:?} ids {:?}", t0.elapsed(), &ids[n_prompt..]);
    Ok(())
}
