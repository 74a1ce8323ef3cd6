// Batched device-to-device copy: one launch copies every piece of a table.
//
// The table holds npieces rows of three 64-bit values: source address,
// destination address, bytes (gpuckpt.device.packing.Packing.pieces: each
// piece at most 1 MiB). Blocks take pieces in turn; the threads of a block
// copy their piece with 16-byte vectors where source, destination and size
// allow it, byte by byte otherwise (views of odd offsets). Used for device
// snapshots (async_save(staging="device")) of states held in many separate
// allocations: one launch instead of one copy per tensor.
//
// Like channels_last.cu, this source includes nothing (NVRTC has no standard
// headers).

extern "C" __global__ void gpuckpt_batched_copy(const unsigned long long* table, long long npieces)
{
    for (long long p = blockIdx.x; p < npieces; p += gridDim.x) {
        const unsigned long long src = table[3 * p];
        const unsigned long long dst = table[3 * p + 1];
        const unsigned long long n = table[3 * p + 2];
        if (((src | dst | n) & 15ull) == 0) {
            const uint4* s = (const uint4*)src;
            uint4* d = (uint4*)dst;
            const unsigned long long words = n >> 4;
            for (unsigned long long i = threadIdx.x; i < words; i += blockDim.x) {
                d[i] = s[i];
            }
        } else {
            const unsigned char* s = (const unsigned char*)src;
            unsigned char* d = (unsigned char*)dst;
            for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) {
                d[i] = s[i];
            }
        }
    }
}
