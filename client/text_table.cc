#include "client/text_table.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>

#include "absl/strings/str_format.h"

namespace moe_ep::client {

TextTable::TextTable(std::vector<std::string> header) : header_(std::move(header)) {}

void TextTable::AddRow(std::vector<std::string> cells) { rows_.push_back(std::move(cells)); }

void TextTable::SetMaxWidth(size_t column, size_t width) {
  if (max_width_.size() <= column) max_width_.resize(column + 1, 0);
  max_width_[column] = std::max<size_t>(width, 1);
}

std::vector<std::string> WrapText(const std::string& text, size_t width) {
  width = std::max<size_t>(width, 1);
  std::vector<std::string> lines;
  size_t pos = 0;
  while (text.size() - pos > width) {
    size_t cut = text.rfind(' ', pos + width);
    if (cut == std::string::npos || cut <= pos) {
      lines.push_back(text.substr(pos, width));
      pos += width;
      continue;
    }
    lines.push_back(text.substr(pos, cut - pos));
    pos = cut + 1;
  }
  lines.push_back(text.substr(pos));
  return lines;
}

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
  // Each row as one or more lines (wrapped cells).
  std::vector<std::vector<std::string>> lines;
  for (const auto& row : rows_) {
    std::vector<std::vector<std::string>> parts(row.size());
    size_t height = 1;
    for (size_t c = 0; c < row.size(); ++c) {
      const size_t limit = c < max_width_.size() ? max_width_[c] : 0;
      parts[c] = limit > 0 ? WrapText(row[c], limit) : std::vector<std::string>{row[c]};
      height = std::max(height, parts[c].size());
    }
    for (size_t l = 0; l < height; ++l) {
      std::vector<std::string> line(row.size());
      for (size_t c = 0; c < row.size(); ++c) {
        if (l < parts[c].size()) line[c] = parts[c][l];
      }
      lines.push_back(std::move(line));
    }
  }
  std::vector<size_t> width(num_cols, 0);
  std::vector<bool> numeric(num_cols, true);
  std::vector<bool> any_cell(num_cols, false);
  auto cell_of = [](const std::vector<std::string>& row, size_t c) -> const std::string& {
    static const std::string kEmpty;
    return c < row.size() ? row[c] : kEmpty;
  };
  for (size_t c = 0; c < num_cols; ++c) {
    width[c] = cell_of(header_, c).size();
    for (const auto& line : lines) width[c] = std::max(width[c], cell_of(line, c).size());
    for (const auto& row : rows_) {
      const std::string& cell = cell_of(row, c);
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
  for (const auto& line : lines) out += render_line(line);
  return out;
}

}  // namespace moe_ep::client
