#include "client/text_table.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>

#include "absl/strings/str_format.h"

namespace moe_ep::client {

TextTable::TextTable(std::vector<std::string> header) : header_(std::move(header)) {}

void TextTable::AddRow(std::vector<std::string> cells) { rows_.push_back(std::move(cells)); }

bool LooksNumeric(const std::string& cell) {
  if (cell.empty()) return false;
  const char* begin = cell.c_str();
  char* end = nullptr;
  std::strtod(begin, &end);
  if (end == begin) return false;
  // strtod also accepts "inf" and "nan"; a cell must start like a number.
  if (!std::isdigit(static_cast<unsigned char>(cell[0])) && cell[0] != '-' && cell[0] != '+' &&
      cell[0] != '.') {
    return false;
  }
  // Whatever follows the number must be a unit: optional space then letters or '%'/'/'.
  for (const char* p = end; *p != '\0'; ++p) {
    const unsigned char c = static_cast<unsigned char>(*p);
    if (!(std::isalpha(c) || c == ' ' || c == '%' || c == '/')) return false;
  }
  return true;
}

std::string FormatBytes(double bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int unit = 0;
  double value = bytes;
  while (std::fabs(value) >= 1024.0 && unit < 5) {
    value /= 1024.0;
    ++unit;
  }
  if (unit == 0) return absl::StrFormat("%.0f B", value);
  const double mag = std::fabs(value);
  if (mag >= 100.0) return absl::StrFormat("%.0f %s", value, kUnits[unit]);
  if (mag >= 10.0) return absl::StrFormat("%.1f %s", value, kUnits[unit]);
  return absl::StrFormat("%.2f %s", value, kUnits[unit]);
}

std::string TextTable::Render() const {
  size_t num_cols = header_.size();
  for (const auto& row : rows_) num_cols = std::max(num_cols, row.size());
  std::vector<size_t> width(num_cols, 0);
  std::vector<bool> numeric(num_cols, true);
  std::vector<bool> any_cell(num_cols, false);
  auto cell_of = [](const std::vector<std::string>& row, size_t c) -> const std::string& {
    static const std::string kEmpty;
    return c < row.size() ? row[c] : kEmpty;
  };
  for (size_t c = 0; c < num_cols; ++c) {
    width[c] = cell_of(header_, c).size();
    for (const auto& row : rows_) {
      const std::string& cell = cell_of(row, c);
      width[c] = std::max(width[c], cell.size());
      if (cell.empty() || cell == "-") continue;
      any_cell[c] = true;
      if (!LooksNumeric(cell)) numeric[c] = false;
    }
    if (!any_cell[c]) numeric[c] = false;
  }
  auto render_line = [&](const std::vector<std::string>& row) {
    std::string line;
    for (size_t c = 0; c < num_cols; ++c) {
      const std::string& cell = cell_of(row, c);
      if (c > 0) line += "  ";
      const size_t pad = width[c] - cell.size();
      // Headers follow their column's alignment so numbers line up under them.
      if (numeric[c]) {
        line.append(pad, ' ');
        line += cell;
      } else {
        line += cell;
        line.append(pad, ' ');
      }
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    return line + "\n";
  };
  std::string out = render_line(header_);
  std::vector<std::string> rule(num_cols);
  for (size_t c = 0; c < num_cols; ++c) rule[c] = std::string(width[c], '-');
  out += render_line(rule);
  for (const auto& row : rows_) out += render_line(row);
  return out;
}

}  // namespace moe_ep::client
