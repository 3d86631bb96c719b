// Minimal MessagePack for the live protocol: maps, arrays, strings, binary, ints, floats, bools, nil.
"use strict";
const MsgPack = (() => {
  const te = new TextEncoder(), td = new TextDecoder();
  function encode(v) {
    const out = [];
    const push = (...b) => out.push(...b);
    // Byte arrays one by one: spreading a long text's bytes into push() overflows the call stack.
    const pushBytes = (bytes) => { for (let i = 0; i < bytes.length; i++) out.push(bytes[i]); };
    const u32 = (n) => push((n >>> 24) & 255, (n >>> 16) & 255, (n >>> 8) & 255, n & 255);
    (function enc(x) {
      if (x === null || x === undefined) push(0xc0);
      else if (x === true) push(0xc3);
      else if (x === false) push(0xc2);
      else if (typeof x === "number" && Number.isInteger(x) && x >= 0 && x < 2 ** 32) {
        if (x < 128) push(x); else { push(0xce); u32(x); }
      } else if (typeof x === "number" && Number.isInteger(x) && x < 0 && x >= -(2 ** 31)) {
        push(0xd2); u32(x >>> 0);
      } else if (typeof x === "number") {
        const b = new DataView(new ArrayBuffer(8)); b.setFloat64(0, x); push(0xcb, ...new Uint8Array(b.buffer));
      } else if (typeof x === "string") {
        const s = te.encode(x);
        if (s.length < 32) push(0xa0 | s.length); else { push(0xdb); u32(s.length); }
        pushBytes(s);
      } else if (x instanceof Uint8Array) { push(0xc6); u32(x.length); pushBytes(x); }
      else if (Array.isArray(x)) { push(0xdd); u32(x.length); x.forEach(enc); }
      else { const k = Object.keys(x); push(0xdf); u32(k.length); k.forEach((key) => { enc(key); enc(x[key]); }); }
    })(v);
    return new Uint8Array(out);
  }
  function decode(buf) {
    const d = new DataView(buf.buffer, buf.byteOffset, buf.byteLength);
    let p = 0;
    const str = (n) => { const s = td.decode(buf.subarray(p, p + n)); p += n; return s; };
    const bin = (n) => { const b = buf.subarray(p, p + n); p += n; return b; };
    const map = (n) => { const o = {}; for (let i = 0; i < n; i++) { const k = dec(); o[k] = dec(); } return o; };
    const arr = (n) => { const a = []; for (let i = 0; i < n; i++) a.push(dec()); return a; };
    function dec() {
      const t = buf[p++];
      if (t < 0x80) return t;
      if (t >= 0xe0) return t - 256;
      if ((t & 0xf0) === 0x80) return map(t & 15);
      if ((t & 0xf0) === 0x90) return arr(t & 15);
      if ((t & 0xe0) === 0xa0) return str(t & 31);
      switch (t) {
        case 0xc0: return null; case 0xc2: return false; case 0xc3: return true;
        case 0xc4: { const n = buf[p]; p += 1; return bin(n); }
        case 0xc5: { const n = d.getUint16(p); p += 2; return bin(n); }
        case 0xc6: { const n = d.getUint32(p); p += 4; return bin(n); }
        case 0xca: { const v = d.getFloat32(p); p += 4; return v; }
        case 0xcb: { const v = d.getFloat64(p); p += 8; return v; }
        case 0xcc: return buf[p++];
        case 0xcd: { const v = d.getUint16(p); p += 2; return v; }
        case 0xce: { const v = d.getUint32(p); p += 4; return v; }
        case 0xcf: { const v = Number(d.getBigUint64(p)); p += 8; return v; }
        case 0xd0: { const v = d.getInt8(p); p += 1; return v; }
        case 0xd1: { const v = d.getInt16(p); p += 2; return v; }
        case 0xd2: { const v = d.getInt32(p); p += 4; return v; }
        case 0xd3: { const v = Number(d.getBigInt64(p)); p += 8; return v; }
        case 0xd9: { const n = buf[p]; p += 1; return str(n); }
        case 0xda: { const n = d.getUint16(p); p += 2; return str(n); }
        case 0xdb: { const n = d.getUint32(p); p += 4; return str(n); }
        case 0xdc: { const n = d.getUint16(p); p += 2; return arr(n); }
        case 0xdd: { const n = d.getUint32(p); p += 4; return arr(n); }
        case 0xde: { const n = d.getUint16(p); p += 2; return map(n); }
        case 0xdf: { const n = d.getUint32(p); p += 4; return map(n); }
      }
      throw new Error("unsupported msgpack type 0x" + t.toString(16));
    }
    return dec();
  }
  return { encode, decode };
})();
