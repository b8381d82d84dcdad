//! Prints a GGUF file's metadata (arrays summarised) and tensor index.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args().nth(1).ok_or("usage: gguf_dump FILE")?;
    let f = engine::gguf::GgufFile::open(std::path::Path::new(&path))?;
    let mut keys: Vec<_> = f.header.metadata.iter().collect();
    keys.sort_by(|a, b| a.0.cmp(b.0));
    for (k, v) in keys {
        match v {
            engine::gguf::MetaValue::Array(a) => println!("{k} = array[{}] first={:?}", a.len(), a.first()),
            engine::gguf::MetaValue::Str(s) if s.len() > 200 => println!("{k} = str[{}] {:?}...", s.len(), &s[..200]),
            v => println!("{k} = {v:?}"),
        }
    }
    for t in f.header.tensors.iter().take(14) {
        println!("{} {:?} {} @{}", t.name, t.dims, t.dtype.name(), t.offset);
    }
    println!("tensors: {}", f.header.tensors.len());
    Ok(())
}
