//! What a cubin (CUDA machine code, an ELF file) is for and what it defines:
//! the architecture in its header and its global function symbols. The
//! build checks every cubin it embeds with this, and CI's test checks the
//! embedded ones (no GPU needed). Shared with the build script (no crate
//! imports).

/// ELF's machine number for NVIDIA CUDA.
pub const EM_CUDA: u16 = 190;

/// A cubin's architecture and kernels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CubinInfo {
    /// The SM version, e.g. 90 for sm_90.
    pub arch: u32,
    /// Names of the global functions it defines (the kernels).
    pub functions: Vec<String>,
}

/// Reads `data` as a 64-bit little-endian CUDA ELF file.
pub fn inspect(data: &[u8]) -> Result<CubinInfo, String> {
    if data.get(..4) != Some(b"\x7fELF".as_slice()) {
        return Err("not an ELF file".into());
    }
    if data.get(4) != Some(&2) || data.get(5) != Some(&1) {
        return Err("not a 64-bit little-endian ELF file".into());
    }
    let machine = u16_at(data, 18)?;
    if machine != EM_CUDA {
        return Err(format!("ELF machine {machine}, not CUDA ({EM_CUDA})"));
    }
    let flags = u32_at(data, 48)?;
    // CUDA's ELF ABI version 8 (CUDA 12.8 and newer) moved the SM number
    // from the low byte of e_flags to the next one.
    let abi_version = data[8];
    let arch = if abi_version >= 8 {
        (flags >> 8) & 0xff
    } else {
        flags & 0xff
    };
    Ok(CubinInfo {
        arch,
        functions: global_functions(data)?,
    })
}

/// The names of defined global `STT_FUNC` symbols of the symbol table.
fn global_functions(data: &[u8]) -> Result<Vec<String>, String> {
    let shoff = u64_at(data, 40)? as usize;
    let shentsize = u16_at(data, 58)? as usize;
    let shnum = u16_at(data, 60)? as usize;
    if shentsize < 64 {
        return Err(format!("section header size {shentsize}"));
    }
    let section = |i: usize| -> Result<(u32, usize, usize, u32), String> {
        let at = shoff
            .checked_add(i.checked_mul(shentsize).ok_or("section index overflows")?)
            .ok_or("section offset overflows")?;
        slice(data, at, shentsize)?;
        let ty = u32_at(data, at + 4)?;
        let offset = u64_at(data, at + 24)? as usize;
        let size = u64_at(data, at + 32)? as usize;
        let link = u32_at(data, at + 40)?;
        Ok((ty, offset, size, link))
    };
    const SHT_SYMTAB: u32 = 2;
    let mut names = Vec::new();
    for i in 0..shnum {
        let (ty, offset, size, link) = section(i)?;
        if ty != SHT_SYMTAB {
            continue;
        }
        let (_, str_off, str_size, _) = section(link as usize)?;
        let strtab = slice(data, str_off, str_size)?;
        let symtab = slice(data, offset, size)?;
        for sym in symtab.chunks_exact(24) {
            let name = u32_at(sym, 0)? as usize;
            let info = sym[4];
            let shndx = u16_at(sym, 6)?;
            const STT_FUNC: u8 = 2;
            const STB_GLOBAL: u8 = 1;
            if info & 0xf == STT_FUNC && info >> 4 == STB_GLOBAL && shndx != 0 {
                names.push(c_str(strtab, name)?);
            }
        }
    }
    Ok(names)
}

fn slice(data: &[u8], at: usize, len: usize) -> Result<&[u8], String> {
    at.checked_add(len)
        .and_then(|end| data.get(at..end))
        .ok_or_else(|| format!("{len} bytes at {at} lie past the end ({})", data.len()))
}

fn c_str(strtab: &[u8], at: usize) -> Result<String, String> {
    let rest = strtab
        .get(at..)
        .ok_or("symbol name past the string table")?;
    let end = rest
        .iter()
        .position(|&b| b == 0)
        .ok_or("unterminated symbol name")?;
    String::from_utf8(rest[..end].to_vec()).map_err(|_| "symbol name is not UTF-8".into())
}

fn u16_at(d: &[u8], at: usize) -> Result<u16, String> {
    let b = slice(d, at, 2)?;
    Ok(u16::from_le_bytes([b[0], b[1]]))
}

fn u32_at(d: &[u8], at: usize) -> Result<u32, String> {
    let b = slice(d, at, 4)?;
    Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

fn u64_at(d: &[u8], at: usize) -> Result<u64, String> {
    let b = slice(d, at, 8)?;
    let mut a = [0; 8];
    a.copy_from_slice(b);
    Ok(u64::from_le_bytes(a))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal ELF64 file: header, a string table, a symbol table with
    /// `syms` (name, info, section index), and their section headers.
    fn elf(machine: u16, abi_version: u8, flags: u32, syms: &[(&str, u8, u16)]) -> Vec<u8> {
        let mut strtab = vec![0u8];
        let mut symtab = vec![0u8; 24]; // the null symbol
        for (name, info, shndx) in syms {
            let mut s = vec![0u8; 24];
            s[0..4].copy_from_slice(&(strtab.len() as u32).to_le_bytes());
            s[4] = *info;
            s[6..8].copy_from_slice(&shndx.to_le_bytes());
            symtab.extend_from_slice(&s);
            strtab.extend_from_slice(name.as_bytes());
            strtab.push(0);
        }
        let mut d = vec![0u8; 64];
        d[..4].copy_from_slice(b"\x7fELF");
        d[4] = 2;
        d[5] = 1;
        d[7] = 0x41;
        d[8] = abi_version;
        d[18..20].copy_from_slice(&machine.to_le_bytes());
        d[48..52].copy_from_slice(&flags.to_le_bytes());
        let str_off = d.len();
        d.extend_from_slice(&strtab);
        let sym_off = d.len();
        d.extend_from_slice(&symtab);
        let shoff = d.len();
        d[40..48].copy_from_slice(&(shoff as u64).to_le_bytes());
        d[58..60].copy_from_slice(&64u16.to_le_bytes());
        d[60..62].copy_from_slice(&3u16.to_le_bytes());
        let header = |ty: u32, off: usize, size: usize, link: u32| {
            let mut h = vec![0u8; 64];
            h[4..8].copy_from_slice(&ty.to_le_bytes());
            h[24..32].copy_from_slice(&(off as u64).to_le_bytes());
            h[32..40].copy_from_slice(&(size as u64).to_le_bytes());
            h[40..44].copy_from_slice(&link.to_le_bytes());
            h
        };
        d.extend_from_slice(&header(0, 0, 0, 0));
        d.extend_from_slice(&header(3, str_off, strtab.len(), 0));
        d.extend_from_slice(&header(2, sym_off, symtab.len(), 1));
        d
    }

    #[test]
    fn reads_arch_and_kernels() {
        let syms = [
            ("weft_p2p", 0x12, 5),          // global function, defined
            ("helper", 0x02, 5),            // local function
            ("weft_coll_f32_sum", 0x12, 6), // global function, defined
            ("undefined", 0x12, 0),         // global function, undefined
            ("data", 0x11, 5),              // global object
        ];
        // ABI 8 (CUDA 13): SM in bits 8-15 (NVRTC 13.0's sm_90: 0x6005a04).
        let info = inspect(&elf(EM_CUDA, 8, 0x6005a04, &syms)).unwrap();
        assert_eq!(info.arch, 90);
        assert_eq!(info.functions, ["weft_p2p", "weft_coll_f32_sum"]);
        assert_eq!(
            inspect(&elf(EM_CUDA, 8, 0x6006402, &syms)).unwrap().arch,
            100
        );
        // ABI 7 (CUDA 12): SM in the low byte.
        assert_eq!(inspect(&elf(EM_CUDA, 7, 0x500550, &syms)).unwrap().arch, 80);
    }

    #[test]
    fn rejects_what_is_not_a_cubin() {
        assert!(inspect(b"").is_err());
        assert!(inspect(b"\x7fELF").is_err());
        let x86 = elf(62, 8, 0, &[]);
        assert!(inspect(&x86).unwrap_err().contains("not CUDA"));
        let good = elf(EM_CUDA, 8, 0x6005a04, &[("k", 0x12, 1)]);
        for cut in [20, 52, 70, good.len() - 1] {
            assert!(inspect(&good[..cut]).is_err(), "cut at {cut}");
        }
    }
}
