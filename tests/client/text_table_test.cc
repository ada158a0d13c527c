#include "client/text_table.h"

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
