#pragma once

// Plain aligned text tables for the CLI: a header row, a rule, then rows.
// Columns are separated by two spaces; numeric-looking cells are right-aligned,
// others left-aligned.
//
//   layer  tokens  pass
//   -----  ------  ----
//       0     768  yes

#include <string>
#include <vector>

namespace moe_ep::client {

class TextTable {
 public:
  explicit TextTable(std::vector<std::string> header);

  // Appends a row. Missing cells are empty; extra cells widen the table
  // (their header is empty).
  void AddRow(std::vector<std::string> cells);
  int num_rows() const { return static_cast<int>(rows_.size()); }

  // Returns the table text, every line ending in '\n', no trailing spaces.
  std::string Render() const;

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

// True when `cell` reads as a number ("12", "-3.5", "1.2e3", "4.0 MiB",
// "87%"): a leading number optionally followed by a unit.
bool LooksNumeric(const std::string& cell);

// Human-readable byte counts with binary units: 0 -> "0 B", 1536 -> "1.5 KiB",
// 3769368960 -> "3.51 GiB". Three significant digits.
std::string FormatBytes(double bytes);

}  // namespace moe_ep::client
