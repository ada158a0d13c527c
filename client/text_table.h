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

  // Cells of `column` (0-based) wider than `width` (>= 1) characters wrap
  // onto continuation lines (WrapText), the other columns blank there, so a
  // long cell (an error message) does not widen the table. Issue 9 item 8.
  void SetMaxWidth(size_t column, size_t width);

  // Returns the table text, every line ending in '\n', no trailing spaces.
  std::string Render() const;

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
  std::vector<size_t> max_width_;  // per column; 0 = unlimited
};

// `text` in lines of at most `width` (>= 1) characters, broken after the last
// space that fits (the space dropped) or, in a word longer than `width`, at
// `width`. "" gives one empty line. Example: WrapText("a bc def", 4) ->
// {"a bc", "def"}.
std::vector<std::string> WrapText(const std::string& text, size_t width);

// True when `cell` reads as a number ("12", "-3.5", "1.2e3", "4.0 MiB",
// "87%"): a leading number optionally followed by a unit.
bool LooksNumeric(const std::string& cell);

// Human-readable byte counts with binary units: 0 -> "0 B", 1536 -> "1.5 KiB",
// 3769368960 -> "3.51 GiB". Three significant digits.
std::string FormatBytes(double bytes);

}  // namespace moe_ep::client
