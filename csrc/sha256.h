// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), for the TCP transport's handshake.
#ifndef EPL_CSRC_SHA256_H_
#define EPL_CSRC_SHA256_H_

#include <cstdint>
#include <string>

namespace epl {

// 32 raw bytes.
std::string Sha256(const std::string& data);
std::string HmacSha256(const std::string& key, const std::string& message);
// Compares without an early exit (the time does not depend on where they differ).
bool SameDigest(const std::string& a, const std::string& b);

}  // namespace epl

// HMAC-SHA256 for ctypes (the tests' RFC 4231 vectors): 32 bytes into `out`.
extern "C" void epl_hmac_sha256(const char* key, long long key_len, const char* message,
                                long long message_len, char* out);

#endif  // EPL_CSRC_SHA256_H_
