#pragma once

// Test PKI made with the openssl command line at test time (never committed):
// a CA, a server certificate for localhost / 127.0.0.1 and a client
// certificate signed by it, and a second, unrelated CA with its own client
// and server certificates (for "signed by someone else" cases). EC P-256
// keys, valid for one day. Header-only so that tests/server and tests/client
// can both use it.

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace moe_ep::testing {

struct TestPki {
  std::string dir;
  std::string ca_cert, ca_key;
  std::string server_cert, server_key;
  std::string client_cert, client_key;
  std::string other_ca_cert, other_ca_key;
  std::string other_server_cert, other_server_key;
  std::string other_client_cert, other_client_key;
};

inline std::string ReadTextFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

inline void WriteTextFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
}

// Runs `command` with the shell; true on exit status 0.
inline bool RunQuiet(const std::string& command) {
  return std::system((command + " >/dev/null 2>&1").c_str()) == 0;
}

// Makes the PKI under a fresh directory below the system temp dir. Returns
// false (and leaves a partial directory) when openssl is missing or fails.
inline bool MakeTestPki(const std::string& name, TestPki* pki) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / (name + "-" + std::to_string(static_cast<long>(::getpid())) +
                                   "-" + std::to_string(std::rand()));
  fs::create_directories(dir);
  pki->dir = dir.string();
  const std::string d = pki->dir + "/";
  const std::string newkey = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  WriteTextFile(d + "server.ext",
                "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
                "keyUsage=digitalSignature,keyEncipherment\n"
                "extendedKeyUsage=serverAuth,clientAuth\n");
  WriteTextFile(d + "client.ext",
                "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
                "extendedKeyUsage=clientAuth\n");
  auto ca = [&](const std::string& stem) {
    return RunQuiet("openssl req -x509 " + newkey + " -keyout " + d + stem + ".key -out " + d +
                    stem + ".crt -days 1 -subj /CN=" + stem);
  };
  auto leaf = [&](const std::string& stem, const std::string& ca_stem, const std::string& ext,
                  const std::string& cn) {
    return RunQuiet("openssl req " + newkey + " -keyout " + d + stem + ".key -out " + d + stem +
                    ".csr -subj /CN=" + cn) &&
           RunQuiet("openssl x509 -req -in " + d + stem + ".csr -CA " + d + ca_stem +
                    ".crt -CAkey " + d + ca_stem + ".key -CAcreateserial -days 1 -out " + d + stem +
                    ".crt -extfile " + d + ext);
  };
  if (!ca("ca") || !ca("other-ca") || !leaf("server", "ca", "server.ext", "localhost") ||
      !leaf("client", "ca", "client.ext", "coordinator") ||
      !leaf("other-server", "other-ca", "server.ext", "localhost") ||
      !leaf("other-client", "other-ca", "client.ext", "intruder")) {
    return false;
  }
  pki->ca_cert = d + "ca.crt";
  pki->ca_key = d + "ca.key";
  pki->server_cert = d + "server.crt";
  pki->server_key = d + "server.key";
  pki->client_cert = d + "client.crt";
  pki->client_key = d + "client.key";
  pki->other_ca_cert = d + "other-ca.crt";
  pki->other_ca_key = d + "other-ca.key";
  pki->other_server_cert = d + "other-server.crt";
  pki->other_server_key = d + "other-server.key";
  pki->other_client_cert = d + "other-client.crt";
  pki->other_client_key = d + "other-client.key";
  return true;
}

}  // namespace moe_ep::testing
