#include "client/text_table.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace moe_ep::client {
namespace {

TEST(TextTable, AlignsNumbersRightAndTextLeft) {
  TextTable t({"layer", "name", "bytes"});
  t.AddRow({"0", "alpha", "12"});
  t.AddRow({"10", "b", "1.5 KiB"});
  EXPECT_EQ(t.Render(),
            "layer  name     bytes\n"
            "-----  -----  -------\n"
            "    0  alpha       12\n"
            "   10  b      1.5 KiB\n");
}

TEST(TextTable, MissingCellsAreEmptyAndNoTrailingSpaces) {
  TextTable t({"a", "b"});
  t.AddRow({"x"});
  t.AddRow({"y", "z", "extra"});
  EXPECT_EQ(t.num_rows(), 2);
  EXPECT_EQ(t.Render(),
            "a  b\n"
            "-  -  -----\n"
            "x\n"
            "y  z  extra\n");
}

TEST(TextTable, WrapsALongCellInsteadOfWideningTheTable) {
  TextTable t({"rank", "error"});
  t.SetMaxWidth(1, 12);
  t.AddRow({"0", "UNAVAILABLE: failed to connect to all addresses"});
  t.AddRow({"1", "ok"});
  EXPECT_EQ(t.Render(),
            "rank  error\n"
            "----  ------------\n"
            "   0  UNAVAILABLE:\n"
            "      failed to\n"
            "      connect to\n"
            "      all\n"
            "      addresses\n"
            "   1  ok\n");
}

TEST(WrapText, BreaksAtSpacesAndInsideLongWords) {
  EXPECT_EQ(WrapText("a bc def", 4), (std::vector<std::string>{"a bc", "def"}));
  EXPECT_EQ(WrapText("abcdefghij", 4), (std::vector<std::string>{"abcd", "efgh", "ij"}));
  EXPECT_EQ(WrapText("", 4), (std::vector<std::string>{""}));
  EXPECT_EQ(WrapText("abcd", 4), (std::vector<std::string>{"abcd"}));
  // Every line fits: a 300-character message at 60 columns.
  const std::string long_text(300, 'x');
  for (const std::string& line : WrapText(absl::StrCat(long_text, " ", long_text), 60)) {
    EXPECT_LE(line.size(), 60u);
  }
}

TEST(LooksNumeric, NumbersWithUnits) {
  EXPECT_TRUE(LooksNumeric("12"));
  EXPECT_TRUE(LooksNumeric("-3.5"));
  EXPECT_TRUE(LooksNumeric("1.2e3"));
  EXPECT_TRUE(LooksNumeric("4.00 MiB"));
  EXPECT_TRUE(LooksNumeric("87%"));
  EXPECT_TRUE(LooksNumeric("3.1 GB/s"));
  EXPECT_FALSE(LooksNumeric("inf"));
  EXPECT_FALSE(LooksNumeric("abc"));
  EXPECT_FALSE(LooksNumeric("127.0.0.1:4000"));
  EXPECT_FALSE(LooksNumeric(""));
}

TEST(FormatBytes, BinaryUnitsThreeDigits) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(1023), "1023 B");
  EXPECT_EQ(FormatBytes(1536), "1.50 KiB");
  EXPECT_EQ(FormatBytes(10.0 * 1024 * 1024), "10.0 MiB");
  // DESIGN §5 check value: 3,769,368,960 B = 3.5105 GiB.
  EXPECT_EQ(FormatBytes(3769368960.0), "3.51 GiB");
  EXPECT_EQ(FormatBytes(200.0 * 1024 * 1024 * 1024), "200 GiB");
}

}  // namespace
}  // namespace moe_ep::client
