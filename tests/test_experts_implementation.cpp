// experts_implementation per backbone and the decode-phase switch of generate.
#include <gtest/gtest.h>

#include "harness.h"
#include "moekit/model/experts_implementation.h"

namespace moekit {
namespace {

using Map = std::map<std::string, std::string>;

TEST(ExpertsImplementation, StartsWithTheDefaultForEveryBackbone) {
  const ExpertsImplementation impl({"text_config", "vision_config"});
  EXPECT_EQ(impl.get(), (Map{{"", "grouped_mm"}, {"text_config", "grouped_mm"}, {"vision_config", "grouped_mm"}}));
  EXPECT_EQ(ExpertsImplementation({}, "eager").get(), (Map{{"", "eager"}}));
}

TEST(ExpertsImplementation, ANameSetsEveryBackboneAndAMapOnlyItsKeys) {
  ExpertsImplementation impl({"text_config", "vision_config"});
  impl.set("batched_mm");
  EXPECT_EQ(impl.get(), (Map{{"", "batched_mm"}, {"text_config", "batched_mm"}, {"vision_config", "batched_mm"}}));
  impl.set(Map{{"text_config", "grouped_mm"}, {"vision_config", "eager"}});
  EXPECT_EQ(impl.get(), (Map{{"", "batched_mm"}, {"text_config", "grouped_mm"}, {"vision_config", "eager"}}));
  impl.set(Map{{"", "eager"}});
  EXPECT_EQ(impl.of(""), "eager");
  EXPECT_EQ(impl.of("text_config"), "grouped_mm");
}

TEST(ExpertsImplementation, TextIsANameOrAJsonObject) {
  ExpertsImplementation impl({"text_config"});
  impl.set_from_text("  eager");
  EXPECT_EQ(impl.get(), (Map{{"", "eager"}, {"text_config", "eager"}}));
  impl.set_from_text(R"({"text_config": "batched_mm"})");
  EXPECT_EQ(impl.get(), (Map{{"", "eager"}, {"text_config", "batched_mm"}}));
}

TEST(ExpertsImplementation, BadInputNamesWhatIsValidAndChangesNothing) {
  ExpertsImplementation impl({"text_config"});
  EXPECT_TRUE(test::throws_error_with([&] { impl.set("fastest_mm"); },
                                      {"unknown experts backend 'fastest_mm'", "grouped_mm", "batched_mm"}));
  EXPECT_TRUE(test::throws_error_with(
      [&] {
        impl.set(Map{{"text_config", "eager"}, {"audio_config", "eager"}});
      },
      {"no backbone \"audio_config\"", "\"text_config\""}));
  EXPECT_EQ(impl.of("text_config"), "grouped_mm") << "a rejected map must not apply its valid entries";
  EXPECT_TRUE(test::throws_error_with([&] { impl.set_from_text(R"({"": "eager",)"); }, {"not valid JSON"}));
  EXPECT_TRUE(test::throws_error_with([&] { impl.set_from_text(R"({"": 3})"); }, {"must be a backend name"}));
  EXPECT_TRUE(test::throws_error_with([&] { (void)impl.of("vision_config"); }, {"no backbone \"vision_config\""}));
  EXPECT_TRUE(test::throws_error_with([] { ExpertsImplementation({"text_config"}, "nope"); }, {"'nope'"}));
}

// The JSON form is user input: deep nesting and repeated keys are refused, bad values described briefly.
TEST(ExpertsImplementation, HostileJsonIsRefusedBriefly) {
  ExpertsImplementation impl({"text_config"});
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  EXPECT_TRUE(test::throws_error_with([&] { impl.set_from_text(R"({"text_config": )" + deep + "}"); },
                                      {"experts_implementation: JSON nests deeper than 128 levels at text_config[0]"}));
  EXPECT_TRUE(test::throws_error_with([&] { impl.set_from_text(R"({"": "eager", "": "batched_mm"})"); },
                                      {"experts_implementation: the key \"\" appears twice"}));
  // 120 kB of value: the message shows its start, not all of it.
  std::string wide = "[1";
  while (wide.size() < 120000) wide += ",1";
  try {
    impl.set_from_text(R"({"text_config": )" + wide + "]}");
    ADD_FAILURE() << "did not throw";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("must be a backend name, got [1,1,1,"), std::string::npos) << message;
    EXPECT_LT(message.size(), 300u) << message;
  }
  EXPECT_EQ(impl.of("text_config"), "grouped_mm");
}

TEST(ExpertsImplementation, DecodeOnAGpuSwitchesOnlyGroupedMmAndRestores) {
  ExpertsImplementation impl({"text_config", "vision_config"});
  impl.set(Map{{"vision_config", "eager"}});
  const Map before = impl.get();
  {
    DecodePhaseSwitch decode(impl, Device::cuda());
    EXPECT_TRUE(decode.switched());
    EXPECT_EQ(impl.get(), (Map{{"", "batched_mm"}, {"text_config", "batched_mm"}, {"vision_config", "eager"}}));
  }
  EXPECT_EQ(impl.get(), before);
}

TEST(ExpertsImplementation, DecodeSwitchRestoresWhenGenerationThrows) {
  ExpertsImplementation impl({"text_config"});
  const Map before = impl.get();
  try {
    DecodePhaseSwitch decode(impl, Device::cuda());
    ASSERT_EQ(impl.of("text_config"), "batched_mm");
    throw Error("generation failed");
  } catch (const Error&) {
  }
  EXPECT_EQ(impl.get(), before);
}

TEST(ExpertsImplementation, DecodeOnTheCpuChangesNothing) {
  ExpertsImplementation impl({"text_config"});
  const Map before = impl.get();
  DecodePhaseSwitch decode(impl, Device::cpu());
  EXPECT_FALSE(decode.switched());
  EXPECT_EQ(impl.get(), before);
}

}  // namespace
}  // namespace moekit
